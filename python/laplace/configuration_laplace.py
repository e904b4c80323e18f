"""LaplaceConfig: the config.json of a Laplace model (SPEC §1, "model_type": "laplace").

A `transformers.PretrainedConfig` when transformers is importable; otherwise a small stand-in with the same
fields, `to_dict`, `from_pretrained` and `save_pretrained`, so the model runs on plain PyTorch.
This file is self-contained (standard library only, transformers optional): `laplace export hf` copies it
into a model directory next to modeling_laplace.py for `trust_remote_code=True` loading.
"""
import copy
import json
import os

try:
    from transformers import PretrainedConfig as _ConfigBase

    HAVE_TRANSFORMERS = True
except ImportError:  # plain PyTorch: a minimal stand-in
    _ConfigBase = None
    HAVE_TRANSFORMERS = False

CONFIG_NAME = "config.json"
# SPEC §1 fields, in config.json order. The first seven are required in a config.json.
LAPLACE_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_k_dim", "head_v_dim",
                  "ffn_size", "conv_size", "chunk_size", "norm_eps", "tie_embeddings")
REQUIRED_FIELDS = LAPLACE_FIELDS[:7]
# Hugging Face names for the same fields (read from config.json, and readable as attributes).
ALIASES = {"num_hidden_layers": "num_layers", "num_attention_heads": "num_heads",
           "intermediate_size": "ffn_size"}
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


class _MinimalConfig(object):
    """What LaplaceConfig needs from PretrainedConfig when transformers is absent."""

    model_type = ""
    attribute_map = {}

    def __init__(self, **kwargs):
        self.name_or_path = str(kwargs.pop("name_or_path", kwargs.pop("_name_or_path", "")))
        kwargs.pop("transformers_version", None)
        for k, v in kwargs.items():
            setattr(self, k, v)

    def __setattr__(self, key, value):
        key = type(self).attribute_map.get(key, key)
        object.__setattr__(self, key, value)

    def __getattr__(self, key):  # only called when normal lookup fails: the HF aliases
        amap = type(self).attribute_map
        if key in amap:
            return getattr(self, amap[key])
        raise AttributeError(key)

    def to_dict(self):
        out = copy.deepcopy({k: v for k, v in self.__dict__.items() if k != "name_or_path"})
        out["model_type"] = self.model_type
        return out

    def to_diff_dict(self):
        return self.to_dict()

    def to_json_string(self, use_diff=True):
        return json.dumps(self.to_diff_dict() if use_diff else self.to_dict(), indent=2) + "\n"

    def save_pretrained(self, save_directory, **kwargs):
        os.makedirs(save_directory, exist_ok=True)
        with open(os.path.join(save_directory, CONFIG_NAME), "w", encoding="utf-8") as f:
            f.write(self.to_json_string())

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        d = dict(config_dict)
        d.update(kwargs)
        return cls(**d)

    @classmethod
    def from_json_file(cls, path):
        with open(path, encoding="utf-8") as f:
            return cls(**json.load(f))

    @classmethod
    def from_pretrained(cls, path, **kwargs):
        f = os.path.join(path, CONFIG_NAME) if os.path.isdir(path) else path
        if not os.path.isfile(f):
            raise OSError("no %s in %s" % (CONFIG_NAME, path))
        with open(f, encoding="utf-8") as fh:
            d = json.load(fh)
        d.update(kwargs)
        d["name_or_path"] = str(path)
        return cls(**d)

    def __repr__(self):
        return "%s %s" % (type(self).__name__, self.to_json_string())


if _ConfigBase is None:
    _ConfigBase = _MinimalConfig


class LaplaceConfig(_ConfigBase):
    r"""Configuration of a Laplace model (SPEC §1).

    Fields (HF aliases in brackets): vocab_size, hidden_size, num_layers [num_hidden_layers],
    num_heads [num_attention_heads], head_k_dim, head_v_dim, ffn_size [intermediate_size], conv_size (4),
    chunk_size (128, the chunk length of the PyTorch GLA form), norm_eps (1e-5), tie_embeddings (False).
    bos/eos/pad_token_id are optional (None unless config.json gives them).
    A config.json whose model_type is not "laplace" is an error, as are non-positive sizes.
    """

    model_type = "laplace"
    keys_to_ignore_at_inference = ["past_key_values"]
    attribute_map = dict(ALIASES)

    def __init__(self, vocab_size=2048, hidden_size=128, num_layers=4, num_heads=4, head_k_dim=32, head_v_dim=64,
                 ffn_size=512, conv_size=4, chunk_size=128, norm_eps=1e-5, tie_embeddings=False, use_cache=True,
                 bos_token_id=None, eos_token_id=None, pad_token_id=None, decay_exponents=None, **kwargs):
        model_type = kwargs.pop("model_type", "laplace")
        if model_type != "laplace":
            raise ValueError("config model_type is %r; a Laplace model needs \"laplace\"" % (model_type,))
        # HF-named fields (config.json files written by other tools) map onto ours.
        given = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                     head_k_dim=head_k_dim, head_v_dim=head_v_dim, ffn_size=ffn_size, conv_size=conv_size,
                     chunk_size=chunk_size, norm_eps=norm_eps, tie_embeddings=tie_embeddings)
        for alias, name in ALIASES.items():
            if alias in kwargs:
                given[name] = kwargs.pop(alias)
        for name in LAPLACE_FIELDS[:9]:
            v = given[name]
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError("config field %r must be a positive integer, got %r" % (name, v))
        if not isinstance(given["norm_eps"], (int, float)) or isinstance(given["norm_eps"], bool) \
                or not given["norm_eps"] > 0:
            raise ValueError("config field 'norm_eps' must be a positive number, got %r" % (given["norm_eps"],))
        if not isinstance(given["tie_embeddings"], bool):
            raise ValueError("config field 'tie_embeddings' must be true or false, got %r" % (given["tie_embeddings"],))
        kwargs.pop("tie_word_embeddings", None)  # derived from tie_embeddings
        for name in LAPLACE_FIELDS:
            setattr(self, name, given[name])
        self.norm_eps = float(self.norm_eps)
        # Optional: lam_h = 1 - 2^(-e_h) instead of e_h = 5 + h (model/config.h's decay_exponents).
        if decay_exponents is not None:
            e = decay_exponents
            if not isinstance(e, (list, tuple)) or any(isinstance(x, bool) or not isinstance(x, int) for x in e) \
                    or len(e) != self.num_heads or any(x < 1 or x > 44 for x in e):
                raise ValueError("config field 'decay_exponents' must be num_heads integers in [1, 44], got %r" % (e,))
            decay_exponents = [int(x) for x in e]
        self.decay_exponents = decay_exponents
        self.use_cache = use_cache
        super().__init__(bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                         tie_word_embeddings=self.tie_embeddings, **kwargs)
        # Set again after the base class, which may reset them.
        self.bos_token_id, self.eos_token_id, self.pad_token_id = bos_token_id, eos_token_id, pad_token_id
        self.tie_word_embeddings = self.tie_embeddings

    # ---- sizes ----
    def param_shapes(self):
        """Canonical tensor names and shapes in canonical order (SPEC §1; laplace_ref.param_shapes)."""
        V, D, L, H = self.vocab_size, self.hidden_size, self.num_layers, self.num_heads
        dk, dv, Fs, K = self.head_k_dim, self.head_v_dim, self.ffn_size, self.conv_size
        out = [("model.embed.weight", (V, D))]
        for i in range(L):
            p = "model.layers.%d." % i
            out += [(p + "norm1.weight", (D,)), (p + "norm1.bias", (D,)), (p + "conv.weight", (D, K)),
                    (p + "wqkvg.weight", (H * (2 * dk + 2 * dv), D)), (p + "onorm.weight", (dv,)),
                    (p + "wo.weight", (D, H * dv)), (p + "norm2.weight", (D,)), (p + "norm2.bias", (D,)),
                    (p + "w12.weight", (2 * Fs, D)), (p + "w3.weight", (D, Fs))]
        out += [("model.norm.weight", (D,)), ("model.norm.bias", (D,))]
        if not self.tie_embeddings:
            out.append(("lm_head.weight", (V, D)))
        return out

    def state_bytes_per_sequence(self):
        """fp32 decode state of one sequence: L x (H*dk*dv + K*D) x 4 bytes, at any context length."""
        return self.num_layers * (self.num_heads * self.head_k_dim * self.head_v_dim +
                                  self.conv_size * self.hidden_size) * 4

    # ---- serialisation: always the SPEC fields, never null token ids (the C++ reader wants integers) ----
    def to_diff_dict(self):
        d = super().to_diff_dict()
        for name in LAPLACE_FIELDS:
            d[name] = getattr(self, name)
        for name in ALIASES:
            d.pop(name, None)
        for name in _TOKEN_IDS:
            if d.get(name, 0) is None:
                d.pop(name)
        d["model_type"] = "laplace"
        return d
