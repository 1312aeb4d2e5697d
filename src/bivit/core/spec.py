"""`EncoderSpec`: what an encoder is made of, checked once (`EncoderSpec.checked`), the one thing every front end
builds from its own input (a command's flags, `load_encoder`'s keywords, `encode_dataset`'s) and hands whole to
`bivit.load_encoder`, the service (`Encoder.spec`), the dataset job and its Ray actors (it pickles).

Imports nothing heavy: the CLI builds and checks one before its inputs are read (checking tries the device, which
loads torch).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

from ..base.dtypes import DEFAULT_DTYPE, canonical_name
from ..base.options import DEMO_SEED
from ..errors import ConfigError
from .packing import check_budget


@dataclass(frozen=True)
class EncoderSpec:
    """What an encoder is made of: every front end (the CLI's commands, the service, the dataset job, its Ray
    actors) builds one from its own input and hands it whole to `bivit.load_encoder`.

    model: None (or "demo") for the demo model, a checkpoint directory or a hub repo id ("org/name[@rev]", or
    `revision`); device: a torch device ("cpu", "cuda[:N]"); dtype: the tower's compute dtype, projector_dtype
    (default: dtype) and output_dtype (default: projector dtype) by name or as torch dtypes (`bivit.base.dtypes`);
    batch_invariant: bit-identical rows per item whatever the batching; alpha: "model", "drop" or "white";
    max_batch_patches: patches per forward pass (None: `bivit.core.packing.MAX_BATCH_PATCHES`), a memory bound, never a
    change of results; processing: overrides the preprocessing (a ProcessorConfig, a preset name or a
    `media_proc_cfg` dict); seed: the demo model's weights.
    """

    model: Optional[Union[str, os.PathLike]] = None
    revision: Optional[str] = None
    device: Any = "cpu"
    dtype: Any = DEFAULT_DTYPE
    projector_dtype: Any = None
    output_dtype: Any = None
    batch_invariant: bool = True
    alpha: str = "model"
    max_batch_patches: Optional[int] = None
    processing: Any = None
    seed: int = DEMO_SEED

    @classmethod
    def of(cls, spec: Any = None, **options: Any) -> "EncoderSpec":
        """`spec` with the fields `options` names replaced; when `spec` is not an EncoderSpec, the spec of
        `options` whose model is `spec` (`load_encoder("org/name", dtype=...)`). ConfigError naming any option
        that is not a field."""
        unknown = sorted(set(options) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ConfigError(f"unknown option(s) {', '.join(map(repr, unknown))}")
        if isinstance(spec, cls):
            return dataclasses.replace(spec, **options)
        return cls(**({} if spec is None else {"model": spec}), **options)

    def checked(self, flags: bool = False, model: bool = True) -> "EncoderSpec":
        """The one validation of an encoder's options: the spec with dtypes by their canonical names and the patch
        budget resolved, else ConfigError naming the option (its command-line flag with `flags`: `--dtype`, else
        its keyword), before anything is loaded. `model`: the model is checked too (an existing directory, whose
        config.json is read now, or a repo id); off for an encoder over weights already in memory, whose `model`
        only names them. Loads torch (the device is tried)."""
        def name(keyword: str) -> str:
            return "--" + keyword.replace("_", "-") if flags else keyword

        budget = check_budget(self.max_batch_patches, name("max_batch_patches"))
        dtypes = {k: canonical_name(getattr(self, k), name(k)) for k in ("dtype", "projector_dtype", "output_dtype")}
        dtypes["dtype"] = dtypes["dtype"] or DEFAULT_DTYPE
        from ..checkpoint import config, hub, preprocess_config, weights  # torch (the device is tried)

        preprocess_config.check_alpha(self.alpha, name("alpha"))
        device = weights.parse_device(self.device)
        if model:
            hub.check_model(self.model, self.revision)
            if self.model is not None and str(self.model) != "demo" and Path(self.model).is_dir():
                config.load_config(Path(self.model))  # a checkpoint's config.json is read now, before any input
        return dataclasses.replace(self, device=str(device), max_batch_patches=budget, **dtypes)
