"""Framework adapters, imported only when used: gradwatch.integrations.huggingface,
gradwatch.integrations.lightning,
gradwatch.integrations.accelerate, gradwatch.integrations.deepspeed."""
