"""From a checkpoint to a model: its configuration (`config`: ModelConfig, presets, both
config.json layouts; `preprocess_config`: the media processor's numbers), its vision weights
(`state_dict`: layouts, shards, keys), hub repo ids (`hub`), and building the model with its
device and fingerprint (`weights`).
"""
