"""Generation engines fed with bivit's embeddings: `bivit.engines.vllm` (vLLM). Nothing here is imported by
`import bivit`; each engine module imports only what its functions need when they run."""
