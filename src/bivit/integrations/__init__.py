"""bivit inside engines and trainers: vLLM (`vllm`, `vllm_plugin`, `vllm_model`), TRL's GRPO (`rl`), the
rows they consume (`rows`), transformers' Kimi-K2.5 (`hf`) and the trainable model (`train`).
Nothing else in bivit imports them, and importing them never imports vLLM (`rl` does only when
`VllmGenerate` generates).
"""
