"""Grammar-constrained decoding in the engine, on the default model (SmolLM2-135M-Instruct):
50 random JSON schemas (hypothesis) decoded greedily in one batch with unconstrained
requests; every answer is valid JSON that validates, and the unconstrained rows decode as
they do alone. The GGUF is dequantized once per test run, into the run's temporary
``$PENSIEVE_CACHE_DIR`` (the ``smollm2_cache`` fixture of conftest.py)."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from pensieve import LLM, SamplingParams
from pensieve.core.sampling_params import GrammarSpec
from pensieve.runner.grammar import GrammarCompiler, GrammarError

NUM_SCHEMAS = 50
MAX_TOKENS = 320

_NAMES = st.from_regex(r"[a-z][a-z_]{0,9}", fullmatch=True)
_SCALARS = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(1, 24)),
    st.just({"type": "integer"}),
    st.builds(lambda lo: {"type": "integer", "minimum": lo, "maximum": lo + 100},
              st.integers(-50, 50)),
    st.just({"type": "number"}),
    st.just({"type": "boolean"}),
    st.builds(lambda vs: {"enum": vs}, st.lists(st.from_regex(r"[a-z]{1,8}", fullmatch=True),
                                                min_size=1, max_size=4, unique=True)),
)
_PROPS = st.one_of(
    _SCALARS,
    st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n},
              _SCALARS, st.integers(1, 3)),
)


@st.composite
def object_schemas(draw, depth: int = 0):
    """An object schema with 1-5 properties (scalars, enums, short arrays, at most one level
    of nested object) and a random ``required`` list."""
    names = draw(st.lists(_NAMES, min_size=1, max_size=5, unique=True))
    inner = _PROPS if depth > 0 else st.one_of(_PROPS, object_schemas(depth=1))
    props = {n: draw(inner) for n in names}
    required = [n for n in names if draw(st.booleans())]
    schema = {"type": "object", "properties": props, "additionalProperties": False}
    if required:
        schema["required"] = required
    return schema


@pytest.fixture(scope="module")
def llm(smollm2_cache):
    return LLM(dtype="float32", device="cpu", num_gpu_blocks=1200, max_num_batched_tokens=2048)


def _prompt(llm, text: str) -> list[int]:
    return list(llm.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                  add_generation_prompt=True, tokenize=True,
                                                  return_dict=True)["input_ids"])


FREE = ["What is the capital of France?", "Write a haiku about the sea.", "List three colors."]


@pytest.mark.slow  # ~30 s: 50 schemas compiled and decoded on the default model
@settings(max_examples=1, deadline=None, derandomize=True, phases=[Phase.generate],
          suppress_health_check=list(HealthCheck))
@given(schemas=st.lists(object_schemas(), min_size=NUM_SCHEMAS, max_size=NUM_SCHEMAS))
def test_random_schemas_validate_in_a_mixed_batch(llm, schemas):
    """Constrained and unconstrained requests share the batch: every constrained answer
    parses and validates against its schema; the free ones equal their unbatched decode."""
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    alone = [llm.generate([_prompt(llm, q)], greedy)[0].output_token_ids for q in FREE]
    prompts, params = [], []
    for i, schema in enumerate(schemas):
        prompts.append(_prompt(llm, f"Reply with a JSON object of this shape: "
                                    f"{json.dumps(schema)} (example {i})"))
        params.append(SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                     grammar=GrammarSpec("json_schema", json.dumps(schema))))
    prompts += [_prompt(llm, q) for q in FREE]
    params += [greedy] * len(FREE)
    outs = llm.generate(prompts, params)
    for schema, out in zip(schemas, outs[:NUM_SCHEMAS]):
        text = llm.tokenizer.decode(out.output_token_ids, skip_special_tokens=True)
        assert out.finish_reason == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)
    assert [o.output_token_ids for o in outs[NUM_SCHEMAS:]] == alone
    runner = llm.engine.executor.runner
    assert runner.grammar is not None and runner.grammar.matchers == {}  # all dropped


def test_json_object_and_unconstrained_first_token(llm):
    """``json_object`` forces JSON where the model, free, starts with prose."""
    p = _prompt(llm, "Tell me about cats.")
    free, obj = llm.generate([p, p], [
        SamplingParams(max_tokens=12, temperature=0.0),
        SamplingParams(max_tokens=200, temperature=0.0, grammar=GrammarSpec("json_object"))])
    assert not llm.tokenizer.decode(free.output_token_ids).lstrip().startswith("{")
    text = llm.tokenizer.decode(obj.output_token_ids, skip_special_tokens=True)
    assert obj.finish_reason == "stop" and isinstance(json.loads(text), dict)


def test_seeded_sampling_stays_in_the_grammar(llm):
    """Temperature sampling draws only tokens the grammar allows."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 999},
                                               "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    params = [SamplingParams(max_tokens=64, temperature=1.5, seed=s,
                             grammar=GrammarSpec("json_schema", json.dumps(schema)))
              for s in range(6)]
    outs = llm.generate([_prompt(llm, "Give me a number.")] * 6, params)
    for o in outs:
        text = llm.tokenizer.decode(o.output_token_ids, skip_special_tokens=True)
        assert o.finish_reason == "stop", text
        jsonschema.validate(json.loads(text), schema)


def test_bad_schemas_name_the_problem(llm):
    compiler = GrammarCompiler(llm.tokenizer)
    with pytest.raises(GrammarError, match="objectx"):
        compiler.compile(GrammarSpec("json_schema", '{"type": "objectx"}'))
    with pytest.raises(GrammarError, match="json schema"):
        compiler.compile(GrammarSpec("json_schema", "{not json"))
    spec = GrammarSpec("json_schema", '{"type": "object"}')
    assert compiler.compile(spec) is compiler.compile(spec)  # cached by its text
