"""Generation engines fed with bivit's embeddings: `bivit.engines.vllm` (vLLM), `bivit.engines.rl` (TRL's GRPO).
Nothing here is imported by `import bivit`, and importing them never imports vLLM (`bivit.engines.rl` does only
when `VllmGenerate` generates)."""
