"""The engine: glue between the scheduling core and the model runner."""
