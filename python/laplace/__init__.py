"""laplace: Laplace language models (gated linear attention with a fixed per-head decay, SPEC §1) for PyTorch and
Hugging Face transformers.

    from laplace import LaplaceForCausalLM, LaplaceTokenizer
    model = LaplaceForCausalLM.from_pretrained("runs/tiny")      # a directory from `laplace train` / `laplace init`
    tok = LaplaceTokenizer.from_pretrained("runs/tiny")
    out = model.generate(**tok("Once upon a time", return_tensors="pt"), max_new_tokens=40)

Importing the package registers "laplace" with transformers' AutoConfig and AutoModelForCausalLM when transformers
is installed; `laplace export hf` makes directories that load with trust_remote_code=True without this package.
"""
from .configuration_laplace import LaplaceConfig
from .modeling_laplace import (HAVE_FLA, HAVE_TRANSFORMERS, LaplaceCache, LaplaceCheckpointError, LaplaceForCausalLM,
                               LaplaceLayer, LaplaceModel, check_model_directory, gla_backend, read_model_weights,
                               read_safetensors, write_safetensors)
from .tokenization_laplace import LaplaceTokenizer

__version__ = "0.1.0"
__all__ = ["LaplaceConfig", "LaplaceForCausalLM", "LaplaceModel", "LaplaceLayer", "LaplaceCache",
           "LaplaceCheckpointError", "LaplaceTokenizer", "check_model_directory", "read_model_weights",
           "read_safetensors", "write_safetensors", "gla_backend", "HAVE_TRANSFORMERS", "HAVE_FLA"]


def _register_auto_classes():
    from transformers import AutoConfig, AutoModelForCausalLM
    for register, args in ((AutoConfig.register, ("laplace", LaplaceConfig)),
                           (AutoModelForCausalLM.register, (LaplaceConfig, LaplaceForCausalLM))):
        try:
            register(*args, exist_ok=True)
        except TypeError:  # transformers without exist_ok
            try:
                register(*args)
            except ValueError:  # already registered
                pass
    # save_pretrained then writes auto_map and copies configuration_laplace.py / modeling_laplace.py, so a saved
    # directory also loads with trust_remote_code=True where this package is not installed.
    LaplaceConfig.register_for_auto_class("AutoConfig")
    LaplaceForCausalLM.register_for_auto_class("AutoModelForCausalLM")


if HAVE_TRANSFORMERS:
    _register_auto_classes()
