"""The step token budget's default per device type, settled in one place."""

import pytest

from pensieve.core.scheduling_config import (
    STEP_TOKEN_BUDGETS,
    SchedulerConfig,
    budget_help,
    default_max_num_batched_tokens,
)
from pensieve.engine.llm import build_engine_config


def test_per_device_defaults() -> None:
    assert default_max_num_batched_tokens("cuda") == SchedulerConfig().max_num_batched_tokens
    assert default_max_num_batched_tokens("cuda") == 8192
    assert default_max_num_batched_tokens("cpu") == STEP_TOKEN_BUDGETS["cpu"]
    assert default_max_num_batched_tokens("cpu") < default_max_num_batched_tokens("cuda")
    assert default_max_num_batched_tokens("mps") == STEP_TOKEN_BUDGETS["cpu"]
    assert all(f"{n} on {d}" in budget_help() for d, n in STEP_TOKEN_BUDGETS.items())


def test_entry_points_take_the_devices_budget() -> None:
    cpu = STEP_TOKEN_BUDGETS["cpu"]
    assert build_engine_config(device="cpu").scheduler.max_num_batched_tokens == cpu
    assert build_engine_config(device="cpu", max_num_batched_tokens=None
                               ).scheduler.max_num_batched_tokens == cpu
    assert build_engine_config(device="cpu", max_num_batched_tokens=77
                               ).scheduler.max_num_batched_tokens == 77
    # without chunked prefill a step must hold a whole prompt: the budget is not lowered
    off = build_engine_config(device="cpu", enable_chunked_prefill=False, max_model_len=4096)
    assert off.scheduler.max_num_batched_tokens == SchedulerConfig().max_num_batched_tokens


@pytest.mark.parametrize("argv", [["serve"], ["generate"]])
def test_command_lines_leave_it_to_the_device(argv: list[str]) -> None:
    from pensieve.cli import build_parser

    args = build_parser().parse_args(argv)
    assert args.max_num_batched_tokens is None
