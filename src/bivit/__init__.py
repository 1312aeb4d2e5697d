"""bivit: batch-invariant vision encoding for Kimi-K2.5/K2.6/K3.

    encoder = bivit.load_encoder()            # demo model; or a checkpoint directory
    embeddings = encoder.encode(["cat.png"])  # one [tokens, text_hidden] tensor per input
"""

from .client import Client
from .dataset import open_dataset
from .encoder import Encoder, load_encoder
from .errors import BivitError, CheckpointError, ConfigError, MediaError
from .media import MediaBatch, image_token_count
from .train import TrainableModel, load_model
from .video import VideoChunk

__all__ = [
    "BivitError", "Client", "open_dataset", "CheckpointError", "ConfigError", "Encoder", "MediaBatch", "MediaError", "image_token_count",
    "load_encoder", "load_model", "TrainableModel", "VideoChunk",
]
__version__ = "0.1.0"
