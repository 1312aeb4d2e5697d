"""The core every front end goes through: `encoder` (load_encoder, Encoder), an input's stages
(`items`: prepare, assemble), the one packing rule (`packing`), the record that leaves the core and
its file format (`records`, `integrity`), vLLM's encoder cache on disk (`encoder_cache`), and
`spec` (EncoderSpec: what an encoder is made of, checked once, built by every front end).
"""
