"""Laplace for PyTorch and Hugging Face transformers: LaplaceForCausalLM and its fixed-size cache.

The model is SPEC §1 (../shared/SPEC.md; executable spec: python/laplace_ref.py, which stays the ground truth
and is what the tests compare this file with). Tensor names are the canonical safetensors names
(model.embed.weight, model.layers.{i}.norm1.weight, ..., lm_head.weight), so `from_pretrained` reads the
model directories that `laplace train` / `laplace init` write (config.json + model.safetensors).

* With transformers importable, LaplaceForCausalLM is a `PreTrainedModel` + `GenerationMixin`: forward(input_ids,
  labels, past_key_values, use_cache, attention_mask) -> CausalLMOutputWithPast, `generate()`, `from_pretrained`,
  `save_pretrained`, gradient checkpointing. Without it, the same class is a plain `torch.nn.Module` with the same
  forward and its own `from_pretrained` / `save_pretrained` for our directories.
* The cache (LaplaceCache) is the fixed state of SPEC §1: per layer the GLA state [B, H, dk, dv] and the conv
  window [B, K, D], both fp32 (fp64 for a float64 model), whatever the context length.
* The GLA mixer uses flash-linear-attention's `chunk_simple_gla` / `fused_recurrent_simple_gla` (fixed per-head
  log decay `g_gamma`) on CUDA when the `fla` package imports, and a plain PyTorch chunked form otherwise
  (LAPLACE_GLA=torch forces the PyTorch form, LAPLACE_GLA=fla requires fla).
* bf16 weights work: LayerNorms and matmuls run in the weights' dtype, the conv, the GLA state, the output
  RMSNorm and the loss in fp32.
* FP8 model directories (`laplace quantize`: body matrices in E4M3 with one F32 scale per row, "<name>_scale")
  load as code times scale (rounded once to float32, as `laplace quantize --dequantize` writes them), in the dtype
  asked for; the products then run in that dtype.
* A checkpoint that does not match the config (a missing tensor, a wrong shape, an unexpected tensor) or a
  config whose model_type is not "laplace" raises an error naming the tensor or field; missing weights are never
  silently initialised.

This file is self-contained (torch + the standard library; transformers and fla optional): `laplace export hf`
copies it, with configuration_laplace.py, into a model directory for `trust_remote_code=True` loading.
"""
import functools
import inspect
import json
import math
import os
import struct

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from .configuration_laplace import LaplaceConfig

try:
    from transformers import PreTrainedModel as _HFPreTrainedModel
    from transformers.modeling_outputs import CausalLMOutputWithPast as _HFOutput
    from transformers.generation import GenerationMixin as _HFGenerationMixin
    HAVE_TRANSFORMERS = True
except ImportError:  # plain PyTorch
    HAVE_TRANSFORMERS = False

try:
    from fla.ops.simple_gla import chunk_simple_gla as _fla_chunk
    from fla.ops.simple_gla import fused_recurrent_simple_gla as _fla_recurrent
    HAVE_FLA = True
except Exception:  # fla absent (or its Triton stack unusable): the PyTorch form
    _fla_chunk = _fla_recurrent = None
    HAVE_FLA = False

SAFETENSORS_NAME = "model.safetensors"
SAFETENSORS_INDEX_NAME = "model.safetensors.index.json"


class LaplaceCheckpointError(ValueError):
    """A checkpoint that does not match its config: the message names the tensor."""


# ------------------------------------------------------------------------------------------------------------
# GLA mixer (SPEC §1): S_t = lam_h S_{t-1} + k_t^T v_t ; o_t = (q_t / sqrt(dk)) S_t, lam_h = 1 - 2^(-5-h)
# ------------------------------------------------------------------------------------------------------------
def head_decays(num_heads, device=None, exponents=None):
    """lam_h = 1 - 2^(-e_h) in float64 (every power of it is taken in float64, then cast), e_h = 5 + h unless the
    config's decay_exponents give them."""
    e = exponents if exponents else [5 + h for h in range(num_heads)]
    return torch.tensor([1.0 - 2.0 ** (-x) for x in e], dtype=torch.float64, device=device)


def _gla_block(q, k, v, S, lam, C):
    """T = N*C tokens in N chunks of C; q pre-scaled. q,k [B,T,H,dk], v [B,T,H,dv], S [B,H,dk,dv], all one dtype.
    Chunk n with entering state S_n: o_i = lam^{i+1} q_i S_n + sum_{j<=i} lam^{i-j} (q_i.k_j) v_j ;
    S_{n+1} = lam^C S_n + sum_j lam^{C-1-j} k_j^T v_j. Intra-chunk work is batched over all chunks."""
    B, T, H, dk = q.shape
    dv, N, dt = v.shape[-1], T // C, q.dtype
    qc = q.reshape(B, N, C, H, dk).permute(0, 3, 1, 2, 4)  # [B,H,N,C,dk]
    kc = k.reshape(B, N, C, H, dk).permute(0, 3, 1, 2, 4)
    vc = v.reshape(B, N, C, H, dv).permute(0, 3, 1, 2, 4)
    i = torch.arange(C, dtype=torch.float64, device=q.device)
    diff = i[:, None] - i[None, :]
    Dm = torch.where(diff >= 0, lam[:, None, None] ** diff.clamp(min=0), torch.zeros((), dtype=torch.float64,
                                                                                     device=q.device))
    A = (qc @ kc.transpose(-1, -2)) * Dm.to(dt)[None, :, None]  # [B,H,N,C,C], causal incl. the diagonal
    o = A @ vc  # [B,H,N,C,dv]
    wk = (lam[:, None] ** (C - 1 - i)).to(dt)  # [H,C]
    kv = (kc * wk[None, :, None, :, None]).transpose(-1, -2) @ vc  # [B,H,N,dk,dv]
    lamC = (lam ** C).to(dt)[None, :, None, None]
    entering = []
    for n in range(N):  # the only sequential part: the state chain
        entering.append(S)
        S = lamC * S + kv[:, :, n]
    Sn = torch.stack(entering, dim=2)  # [B,H,N,dk,dv]
    wq = (lam[:, None] ** (i + 1)).to(dt)  # [H,C]
    o = o + (qc * wq[None, :, None, :, None]) @ Sn
    return o.permute(0, 2, 3, 1, 4).reshape(B, T, H, dv), S


def gla_torch(q, k, v, S0, scale, chunk, exponents=None):
    """Plain-PyTorch GLA over q,k [B,T,H,dk], v [B,T,H,dv] from state S0 [B,H,dk,dv] (None: zeros).
    Computes in float32 (float64 for float64 inputs). Returns (o [B,T,H,dv], S_T [B,H,dk,dv]) in that dtype.
    One token: the recurrent step; more: chunks of `chunk` tokens (the tail chunk shorter)."""
    cd = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, T, H, dk = q.shape
    dv = v.shape[-1]
    q, k, v = q.to(cd) * scale, k.to(cd), v.to(cd)
    S = torch.zeros(B, H, dk, dv, dtype=cd, device=q.device) if S0 is None else S0.to(cd)
    lam = head_decays(H, q.device, exponents)
    if T == 1:
        S = lam.to(cd)[None, :, None, None] * S + k[:, 0, :, :, None] * v[:, 0, :, None, :]
        return (q[:, 0, :, None, :] @ S).reshape(B, 1, H, dv), S
    outs = []
    main = (T // chunk) * chunk
    if main:
        o, S = _gla_block(q[:, :main], k[:, :main], v[:, :main], S, lam, chunk)
        outs.append(o)
    if T > main:
        o, S = _gla_block(q[:, main:], k[:, main:], v[:, main:], S, lam, T - main)
        outs.append(o)
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)), S


@functools.lru_cache(maxsize=None)
def _fla_kwargs(fn):
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    if "g_gamma" not in params:  # an fla too old for a fixed per-head decay
        return None
    return (("head_first", False),) if "head_first" in params else ()


def gla_backend(q):
    """'fla' or 'torch' for these inputs. LAPLACE_GLA=torch|fla|auto (default auto: fla on CUDA when importable)."""
    want = os.environ.get("LAPLACE_GLA", "auto").lower()
    usable = HAVE_FLA and q.is_cuda and q.dtype in (torch.float32, torch.bfloat16, torch.float16) \
        and _fla_kwargs(_fla_chunk) is not None
    if want == "torch":
        return "torch"
    if want == "fla":
        if not usable:
            raise RuntimeError("LAPLACE_GLA=fla but flash-linear-attention cannot run here (needs the fla package "
                               "with g_gamma support, CUDA tensors, fp32/bf16/fp16)")
        return "fla"
    return "fla" if usable else "torch"


def gla(q, k, v, S0, scale, chunk, need_state=True, exponents=None):
    """Dispatch to flash-linear-attention or the PyTorch form. S0 and the returned state are fp32 (fp64 stays)."""
    if gla_backend(q) == "torch":
        return gla_torch(q, k, v, S0, scale, chunk, exponents)
    H = q.shape[2]
    gamma = torch.log(head_decays(H, q.device, exponents)).to(torch.float32)  # ln lam_h, [H]
    S0 = None if S0 is None else S0.to(torch.float32).contiguous()
    small = q.shape[1] <= 16 and not torch.is_grad_enabled()
    fn = _fla_recurrent if small and _fla_kwargs(_fla_recurrent) is not None else _fla_chunk
    kw = dict(_fla_kwargs(fn))
    o, S = fn(q, k, v, g_gamma=gamma, scale=scale, initial_state=S0, output_final_state=need_state, **kw)
    return o, S


# ------------------------------------------------------------------------------------------------------------
# The cache: the fixed-size state of SPEC §1
# ------------------------------------------------------------------------------------------------------------
class LaplaceCache(object):
    """The decode state of a batch: per layer (gla_state [B,H,dk,dv], conv_window [B,K,D]), fp32, plus the number of
    tokens seen. Its size does not depend on that number (config.state_bytes_per_sequence() bytes per sequence).
    The model replaces the tensors of layer i when it runs on new tokens (the object is updated and returned)."""

    is_compileable = False  # read by transformers' generate

    def __init__(self, states=None, seen_tokens=0):
        self.states = list(states) if states is not None else []
        self.seen_tokens = int(seen_tokens)

    @classmethod
    def zeros(cls, config, batch_size, device=None, dtype=torch.float32):
        c = config
        return cls([(torch.zeros(batch_size, c.num_heads, c.head_k_dim, c.head_v_dim, dtype=dtype, device=device),
                     torch.zeros(batch_size, c.conv_size, c.hidden_size, dtype=dtype, device=device))
                    for _ in range(c.num_layers)])

    def layer(self, i):
        return self.states[i] if i < len(self.states) else (None, None)

    def get_seq_length(self, layer_idx=0):
        return self.seen_tokens

    def get_max_length(self):  # no maximum: the state is fixed-size
        return None

    def get_max_cache_shape(self):
        return None

    @property
    def batch_size(self):
        return self.states[0][0].shape[0] if self.states else 0

    def nbytes(self):
        return sum(S.numel() * S.element_size() + w.numel() * w.element_size() for S, w in self.states)

    def reorder_cache(self, beam_idx):
        """Beam search: keep rows beam_idx (in place)."""
        self.states = [(S.index_select(0, beam_idx.to(S.device)), w.index_select(0, beam_idx.to(w.device)))
                       for S, w in self.states]
        return self

    def batch_repeat_interleave(self, repeats):
        self.states = [(S.repeat_interleave(repeats, 0), w.repeat_interleave(repeats, 0)) for S, w in self.states]
        return self

    def batch_select_indices(self, indices):
        self.states = [(S[indices], w[indices]) for S, w in self.states]
        return self

    def detach(self):
        """Truncated backpropagation through time: the same values, no graph."""
        return LaplaceCache([(S.detach(), w.detach()) for S, w in self.states], self.seen_tokens)

    def to_tensors(self):
        """{layers.{i}.gla_state, layers.{i}.conv_window}: the names laplace_ref and the C++ state files use."""
        out = {}
        for i, (S, w) in enumerate(self.states):
            out["layers.%d.gla_state" % i], out["layers.%d.conv_window" % i] = S, w
        return out

    @classmethod
    def from_tensors(cls, tensors, num_layers, seen_tokens=0):
        return cls([(tensors["layers.%d.gla_state" % i], tensors["layers.%d.conv_window" % i])
                    for i in range(num_layers)], seen_tokens)

    def __len__(self):
        return len(self.states)

    def __getitem__(self, i):
        return self.states[i]

    def __iter__(self):
        return iter(self.states)

    def __repr__(self):
        return "LaplaceCache(layers=%d, batch=%d, seen_tokens=%d, bytes=%d)" % (
            len(self.states), self.batch_size, self.seen_tokens, self.nbytes())


# ------------------------------------------------------------------------------------------------------------
# Modules (names = canonical tensor names)
# ------------------------------------------------------------------------------------------------------------
def _state_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


class LaplaceLayer(nn.Module):
    """One layer of SPEC §1: token mixer (LayerNorm, causal depthwise conv + SiLU, W_qkvg, GLA, per-head RMSNorm x
    SiLU gate, W_o) and channel mixer (LayerNorm, W_12, SiLU(a) * b, W_3), each with a residual."""

    def __init__(self, config):
        super().__init__()
        c = config
        D, H, dk, dv, K = c.hidden_size, c.num_heads, c.head_k_dim, c.head_v_dim, c.conv_size
        self.D, self.H, self.dk, self.dv, self.K, self.Fs = D, H, dk, dv, K, c.ffn_size
        self.eps, self.chunk = float(c.norm_eps), int(c.chunk_size)
        self.decay_exponents = getattr(c, "decay_exponents", None)
        self.norm1 = nn.LayerNorm(D, eps=self.eps)
        self.conv = nn.Module()
        self.conv.weight = nn.Parameter(torch.empty(D, K))
        self.wqkvg = nn.Linear(D, H * (2 * dk + 2 * dv), bias=False)
        self.onorm = nn.Module()
        self.onorm.weight = nn.Parameter(torch.empty(dv))
        self.wo = nn.Linear(H * dv, D, bias=False)
        self.norm2 = nn.LayerNorm(D, eps=self.eps)
        self.w12 = nn.Linear(D, 2 * c.ffn_size, bias=False)
        self.w3 = nn.Linear(c.ffn_size, D, bias=False)

    def forward(self, x, S0=None, win=None, mask=None, need_state=True):
        """x [B,T,D]; S0 [B,H,dk,dv] and win [B,K,D] (None: zeros); mask [B,T] (1 = token, 0 = padding).
        Returns (x, S_T, window). A padding position contributes nothing to the state, so left padding is exact."""
        B, T, D = x.shape
        H, dk, dv, K = self.H, self.dk, self.dv, self.K
        dt, sdt = x.dtype, _state_dtype(x.dtype)
        u = F.layer_norm(x, (D,), self.norm1.weight, self.norm1.bias, self.eps)
        if mask is not None:
            u = u * mask[:, :, None].to(dt)
        if win is None:
            win = torch.zeros(B, K, D, dtype=dt, device=x.device)
        ext = torch.cat([win.to(dt), u], dim=1)  # [B, K+T, D]; ext[K+t] = u_t
        # The conv and its SiLU in fp32, rounded once to the compute dtype, as the CUDA kernel does:
        # each bf16 rounding of a partial sum would add error.
        wc, ext_s = self.conv.weight.to(sdt), ext.to(sdt)
        cv = F.silu(sum(wc[:, j] * ext_s[:, 1 + j:1 + j + T] for j in range(K))).to(dt)
        new_win = ext[:, -K:].to(sdt)
        qkvg = self.wqkvg(cv)
        hk, hv = H * dk, H * dv
        q = qkvg[..., :hk].reshape(B, T, H, dk)
        k = qkvg[..., hk:2 * hk].reshape(B, T, H, dk)
        v = qkvg[..., 2 * hk:2 * hk + hv].reshape(B, T, H, dv)
        g = qkvg[..., 2 * hk + hv:].reshape(B, T, H, dv)
        o, S = gla(q, k, v, S0, 1.0 / math.sqrt(dk), self.chunk, need_state, self.decay_exponents)
        o = o.to(sdt)  # the output RMSNorm and the gate in fp32 (fp64 for a float64 model)
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps) * self.onorm.weight.to(sdt)
        y = (o * F.silu(g.to(sdt))).reshape(B, T, hv).to(dt)
        x = x + self.wo(y)
        z = F.layer_norm(x, (D,), self.norm2.weight, self.norm2.bias, self.eps)
        ab = self.w12(z)
        x = x + self.w3(F.silu(ab[..., :self.Fs]) * ab[..., self.Fs:])
        return x, (None if S is None else S.to(sdt)), new_win


class LaplaceModel(nn.Module):
    """Embedding, L layers, final LayerNorm: tokens -> hidden states [B,T,D] and the new state."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([LaplaceLayer(config) for _ in range(config.num_layers)])
        self.norm = nn.LayerNorm(config.hidden_size, eps=float(config.norm_eps))
        self.gradient_checkpointing = False

    def forward(self, input_ids=None, cache=None, attention_mask=None, inputs_embeds=None, use_cache=True,
                output_hidden_states=False):
        """Returns (hidden [B,T,D] after the final norm, new LaplaceCache or None, tuple of hidden states or None).
        `cache` is read (None: zero state) and, when use_cache, updated in place and returned."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids and inputs_embeds")
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        B, T, _ = x.shape
        mask = None
        if attention_mask is not None:
            if attention_mask.dim() != 2 or attention_mask.shape[0] != B or attention_mask.shape[1] < T:
                raise ValueError("attention_mask must be [batch, >= %d] (2-D, 1 = token, 0 = padding), got %s"
                                 % (T, tuple(attention_mask.shape)))
            mask = attention_mask[:, -T:]
        if cache is not None and cache.states and cache.batch_size != B:
            raise ValueError("the cache holds %d sequences, the input %d" % (cache.batch_size, B))
        hidden = (x,) if output_hidden_states else None
        new_states = []
        ckpt = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for i, layer in enumerate(self.layers):
            S0, win = cache.layer(i) if cache is not None else (None, None)
            if ckpt:
                fn = getattr(self, "_gradient_checkpointing_func", None)
                if fn is None:
                    fn = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
                x, S, w = fn(layer.__call__, x, S0, win, mask, use_cache)
            else:
                x, S, w = layer(x, S0, win, mask, use_cache)
            new_states.append((S, w))
            if output_hidden_states:
                hidden = hidden + (x,)
        x = F.layer_norm(x, (x.shape[-1],), self.norm.weight, self.norm.bias, self.norm.eps)
        new_cache = None
        if use_cache:
            new_cache = cache if cache is not None else LaplaceCache()
            new_cache.states = new_states
            new_cache.seen_tokens += T
        return x, new_cache, hidden


def _init_tensor(t, fn):
    """Initialise t unless transformers marked it as loaded from a checkpoint."""
    if not getattr(t, "_is_hf_initialized", False):
        with torch.no_grad():
            fn(t)


def init_laplace_weights(module, config):
    """laplace_ref.init_params' distributions: matrices and embedding N(0, 0.02), W_o and W_3 N(0, 0.02/sqrt(2L)),
    conv N(0, 1/sqrt(K)), LayerNorm weights 1 and biases 0, onorm 1. (The RNG stream is PyTorch's, not numpy's.)"""
    std, std_out = 0.02, 0.02 / math.sqrt(2 * config.num_layers)
    if isinstance(module, LaplaceLayer):
        for ln in (module.norm1, module.norm2):
            _init_tensor(ln.weight, nn.init.ones_)
            _init_tensor(ln.bias, nn.init.zeros_)
        _init_tensor(module.conv.weight, lambda t: nn.init.normal_(t, 0.0, 1.0 / math.sqrt(config.conv_size)))
        _init_tensor(module.wqkvg.weight, lambda t: nn.init.normal_(t, 0.0, std))
        _init_tensor(module.onorm.weight, nn.init.ones_)
        _init_tensor(module.wo.weight, lambda t: nn.init.normal_(t, 0.0, std_out))
        _init_tensor(module.w12.weight, lambda t: nn.init.normal_(t, 0.0, std))
        _init_tensor(module.w3.weight, lambda t: nn.init.normal_(t, 0.0, std_out))
    elif isinstance(module, LaplaceModel):
        _init_tensor(module.embed.weight, lambda t: nn.init.normal_(t, 0.0, std))
        _init_tensor(module.norm.weight, nn.init.ones_)
        _init_tensor(module.norm.bias, nn.init.zeros_)
    elif getattr(module, "_is_laplace_lm", False) and module.lm_head is not None:
        _init_tensor(module.lm_head.weight, lambda t: nn.init.normal_(t, 0.0, std))


# ------------------------------------------------------------------------------------------------------------
# Checkpoint checks and the safetensors format (own reader/writer: no `safetensors` package needed)
# ------------------------------------------------------------------------------------------------------------
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}
FP8_DTYPE = "F8_E4M3"  # a body matrix of an FP8 directory; its per-row F32 scales are "<name>_scale"


def _e4m3_values():
    """The 256 E4M3 codes as float32 (OCP FP8: bias 7, subnormals, 0x7F/0xFF NaN, no infinities)."""
    v = []
    for b in range(256):
        e, m = (b >> 3) & 0xF, b & 7
        if e == 15 and m == 7:
            x = float("nan")
        elif e == 0:
            x = m / 8.0 * 2.0 ** -6
        else:
            x = (1.0 + m / 8.0) * 2.0 ** (e - 7)
        v.append(-x if b & 0x80 else x)
    return torch.tensor(v, dtype=torch.float32)


_E4M3 = _e4m3_values()


def fp8_scale_name(name):
    return name + "_scale"


def read_safetensors_header(path):
    """-> {name: (dtype string, shape tuple)} from the JSON header, without reading the data."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise LaplaceCheckpointError("%s: not a safetensors file (shorter than 8 bytes)" % path)
        (n,) = struct.unpack("<Q", head)
        if n > 100000000:
            raise LaplaceCheckpointError("%s: not a safetensors file (header length %d)" % (path, n))
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except ValueError as e:
        raise LaplaceCheckpointError("%s: corrupt safetensors header (%s)" % (path, e))
    return {k: (v.get("dtype"), tuple(v.get("shape", ()))) for k, v in header.items() if k != "__metadata__"}


def read_safetensors(path):
    """-> {name: CPU tensor}. F8_E4M3 tensors come back as float32 holding their codes' values (unscaled:
    dequantize_fp8 applies the scales)."""
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n].decode("utf-8"))
    data = memoryview(blob)[8 + n:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        fp8 = info["dtype"] == FP8_DTYPE
        if info["dtype"] not in _ST_DTYPES and not fp8:
            raise LaplaceCheckpointError("%s: tensor %s has unsupported dtype %s" % (path, name, info["dtype"]))
        b, e = info["data_offsets"]
        dt = torch.uint8 if fp8 else _ST_DTYPES[info["dtype"]]
        t = torch.frombuffer(bytearray(data[b:e]), dtype=dt) if e > b else torch.empty(0, dtype=dt)
        if fp8:
            t = _E4M3[t.long()]
        out[name] = t.reshape(info["shape"])
    return out


def fp8_matrices(headers):
    """{name: (dtype, shape)} (read_safetensors_header's) -> the names of the FP8 matrices, each checked to have
    its per-row scale, F32 [rows]."""
    names = sorted(n for n, (dt, _) in headers.items() if dt == FP8_DTYPE)
    for n in names:
        sn = fp8_scale_name(n)
        shape = headers[n][1]
        if sn not in headers:
            raise LaplaceCheckpointError("tensor %s is FP8 (%s) but its scales, %s, are missing" % (n, FP8_DTYPE, sn))
        if headers[sn][0] != "F32" or tuple(headers[sn][1]) != (shape[0] if shape else 1,):
            raise LaplaceCheckpointError("scales %s are %s %s; FP8 tensor %s %s needs F32 [%d]" % (
                sn, headers[sn][0], _fmt_shape(headers[sn][1]), n, _fmt_shape(shape), shape[0] if shape else 1))
    return names


def dequantize_fp8(tensors, names):
    """tensors (read_safetensors') with the FP8 matrices `names` replaced by code value × row scale (one float32
    rounding, as `laplace quantize --dequantize` does) and their scales removed."""
    out = dict(tensors)
    for n in names:
        scale = out.pop(fp8_scale_name(n))
        w = out[n]
        # a quantiser writes finite, positive scales and saturates (no NaN code): anything else is a damaged file
        bad = ~(torch.isfinite(scale) & (scale > 0))
        if bool(bad.any()):
            r = int(bad.nonzero()[0][0])
            raise LaplaceCheckpointError("%s: row %d's scale is %r (a scale must be finite and positive)"
                                         % (fp8_scale_name(n), r, float(scale[r])))
        nan = torch.isnan(w.reshape(w.shape[0], -1))
        if bool(nan.any()):
            r, c = (int(x) for x in nan.nonzero()[0])
            raise LaplaceCheckpointError("%s: a NaN code at row %d, column %d (FP8 weights hold none)" % (n, r, c))
        out[n] = (w.reshape(w.shape[0], -1) * scale.reshape(-1, 1)).reshape(w.shape)
    return out


def read_model_weights(files):
    """{name: CPU tensor} of a model's safetensors files (check_model_directory's), FP8 matrices dequantized."""
    tensors, headers = {}, {}
    for fp in files:
        headers.update(read_safetensors_header(fp))
        tensors.update(read_safetensors(fp))
    return dequantize_fp8(tensors, fp8_matrices(headers))


def write_safetensors(path, tensors, metadata=None):
    """Tensors sorted by name, {"format": "pt"} metadata, header padded to 8 bytes; written atomically."""
    meta = {"format": "pt"}
    meta.update({str(k): str(v) for k, v in (metadata or {}).items()})
    header, chunks, off = {"__metadata__": meta}, [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        if t.dtype not in _ST_NAMES:
            raise ValueError("unsupported dtype %s for %s" % (t.dtype, name))
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": _ST_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + len(raw)]}
        chunks.append(raw)
        off += len(raw)
    hj = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hj += b" " * (-len(hj) % 8)
    tmp = "%s.tmp.%d" % (path, os.getpid())
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(hj)))
        f.write(hj)
        for c in chunks:
            f.write(c)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fmt_shape(s):
    return "[%s]" % ", ".join(str(int(x)) for x in s)


def check_tensor_shapes(config, found, where="checkpoint"):
    """found: {name: shape}. Raises LaplaceCheckpointError naming the first missing, mis-shaped or unexpected
    tensor against config.param_shapes()."""
    expected = config.param_shapes()
    exp_names = set(n for n, _ in expected)
    missing = [n for n, _ in expected if n not in found]
    if missing:
        shape = dict(expected)[missing[0]]
        more = " (and %d more missing)" % (len(missing) - 1) if len(missing) > 1 else ""
        raise LaplaceCheckpointError("%s lacks tensor %s %s%s; missing weights are never initialised at random"
                                     % (where, missing[0], _fmt_shape(shape), more))
    for n, shape in expected:
        if tuple(found[n]) != tuple(shape):
            raise LaplaceCheckpointError("%s: tensor %s has shape %s, the config needs %s"
                                         % (where, n, _fmt_shape(found[n]), _fmt_shape(shape)))
    extra = sorted(n for n in found if n not in exp_names)
    if extra:
        more = " (and %d more)" % (len(extra) - 1) if len(extra) > 1 else ""
        raise LaplaceCheckpointError("%s has unexpected tensor %s%s: not a parameter of this config%s"
                                     % (where, extra[0], more,
                                        " (tie_embeddings is true)" if extra[0] == "lm_head.weight" else ""))


def check_model_directory(config, path):
    """Checks the safetensors of a local model directory (model.safetensors, or the shards of
    model.safetensors.index.json) against config before any weight is loaded. Returns the files checked."""
    single = os.path.join(path, SAFETENSORS_NAME)
    index = os.path.join(path, SAFETENSORS_INDEX_NAME)
    if os.path.isfile(single):
        files = [single]
    elif os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            files = [os.path.join(path, s) for s in sorted(set(json.load(f)["weight_map"].values()))]
    else:
        raise LaplaceCheckpointError("model directory %s has no %s" % (path, SAFETENSORS_NAME))
    headers = {}
    for fp in files:
        headers.update(read_safetensors_header(fp))
    where = files[0] if len(files) == 1 else index
    try:
        scales = set(fp8_scale_name(n) for n in fp8_matrices(headers))
    except LaplaceCheckpointError as e:
        raise LaplaceCheckpointError("%s: %s" % (where, e))
    check_tensor_shapes(config, {n: s for n, (_, s) in headers.items() if n not in scales}, where)
    return files


def is_fp8_directory(path):
    """True when a local model directory's weights hold FP8 matrices (`laplace quantize`)."""
    single = os.path.join(path, SAFETENSORS_NAME)
    return os.path.isfile(single) and any(dt == FP8_DTYPE for dt, _ in read_safetensors_header(single).values())


def _load_config(path_or_config, **kwargs):
    if isinstance(path_or_config, LaplaceConfig):
        return path_or_config
    f = os.path.join(path_or_config, "config.json") if os.path.isdir(path_or_config) else path_or_config
    if not os.path.isfile(f):
        raise OSError("no config.json in %s" % path_or_config)
    with open(f, encoding="utf-8") as fh:
        d = json.load(fh)
    if d.get("model_type") != "laplace":
        raise ValueError("%s: model_type is %r; a Laplace model needs \"laplace\"" % (f, d.get("model_type")))
    d.update(kwargs)
    return LaplaceConfig(**d)


# ------------------------------------------------------------------------------------------------------------
# The causal LM (shared by the transformers class and the plain-PyTorch class)
# ------------------------------------------------------------------------------------------------------------
class LaplaceOutput(object):
    """forward's result without transformers (CausalLMOutputWithPast's fields)."""

    def __init__(self, loss=None, logits=None, past_key_values=None, hidden_states=None):
        self.loss, self.logits, self.past_key_values, self.hidden_states = loss, logits, past_key_values, hidden_states

    def __getitem__(self, key):
        return getattr(self, key) if isinstance(key, str) else self.to_tuple()[key]

    def __contains__(self, key):
        return getattr(self, key, None) is not None

    def to_tuple(self):
        return tuple(v for v in (self.loss, self.logits, self.past_key_values, self.hidden_states) if v is not None)


def causal_lm_loss(logits, labels, num_items_in_batch=None, ignore_index=-100):
    """HF convention: labels are the inputs; position t predicts labels[t+1]; -100 is ignored. fp32."""
    lg = logits[:, :-1].float().reshape(-1, logits.shape[-1])
    y = labels[:, 1:].reshape(-1).to(lg.device)
    if num_items_in_batch is not None:
        return F.cross_entropy(lg, y, ignore_index=ignore_index, reduction="sum") / num_items_in_batch
    return F.cross_entropy(lg, y, ignore_index=ignore_index)


class _LaplaceLMMixin(object):
    """forward / generation glue of LaplaceForCausalLM (self.model, self.lm_head, self.config)."""

    _is_laplace_lm = True

    def _build(self, config):
        self.model = LaplaceModel(config)
        if config.tie_embeddings:
            self.lm_head = None  # the head is model.embed.weight
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def get_input_embeddings(self):
        return self.model.embed

    def set_input_embeddings(self, value):
        self.model.embed = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def get_decoder(self):
        return self.model

    def head_weight(self):
        return self.model.embed.weight if self.lm_head is None else self.lm_head.weight

    def new_cache(self, batch_size, device=None):
        """An all-zero state for batch_size sequences (what a forward without a cache starts from)."""
        p = self.model.embed.weight
        return LaplaceCache.zeros(self.config, batch_size, device or p.device, _state_dtype(p.dtype))

    def forward(self, input_ids=None, attention_mask=None, past_key_values=None, inputs_embeds=None, labels=None,
                use_cache=None, output_hidden_states=None, return_dict=None, logits_to_keep=0, **kwargs):
        """input_ids [B,T]; labels [B,T] (the inputs; shifted inside; -100 ignored) -> loss;
        past_key_values: a LaplaceCache (None: zero state), updated and returned when use_cache;
        attention_mask [B,T_total] (left padding exact); logits_to_keep: the last n positions only (0: all)."""
        if use_cache is None:
            use_cache = bool(getattr(self.config, "use_cache", True)) and not self.training
        if return_dict is None:
            return_dict = bool(getattr(self.config, "return_dict", True))
        cache = past_key_values if isinstance(past_key_values, LaplaceCache) else None
        if past_key_values is not None and cache is None and not _is_empty_hf_cache(past_key_values):
            raise TypeError("past_key_values must be a LaplaceCache (the fixed Laplace state), got %s"
                            % type(past_key_values).__name__)
        hidden, new_cache, all_hidden = self.model(input_ids, cache, attention_mask, inputs_embeds, use_cache,
                                                   bool(output_hidden_states))
        keep = kwargs.get("num_logits_to_keep", logits_to_keep)
        if isinstance(keep, int) and keep > 0:
            hidden = hidden[:, -keep:]
        elif isinstance(keep, torch.Tensor):
            hidden = hidden[:, keep]
        logits = F.linear(hidden, self.head_weight())
        loss = None
        if labels is not None:
            loss = causal_lm_loss(logits, labels, kwargs.get("num_items_in_batch"))
        if not return_dict:
            out = (logits,) + ((new_cache,) if use_cache else ()) + ((all_hidden,) if output_hidden_states else ())
            return ((loss,) + out) if loss is not None else out
        return _Output(loss=loss, logits=logits, past_key_values=new_cache, hidden_states=all_hidden)

    # ---- generation: only the tokens the state has not seen are fed ----
    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, attention_mask=None,
                                      inputs_embeds=None, use_cache=True, next_sequence_length=None,
                                      cache_position=None, **kwargs):
        cache = past_key_values if isinstance(past_key_values, LaplaceCache) else None
        seen = cache.get_seq_length() if cache is not None else 0
        total = input_ids.shape[1]
        if next_sequence_length is not None and next_sequence_length > 0:
            n = int(next_sequence_length)
        elif cache is not None and seen > 0 and isinstance(cache_position, torch.Tensor) \
                and 0 < cache_position.numel() <= total:
            n = int(cache_position.numel())
        elif cache is not None and 0 < seen < total:
            n = total - seen
        else:
            n = total
        inputs = {"past_key_values": cache, "use_cache": use_cache}
        if inputs_embeds is not None and seen == 0:
            inputs["inputs_embeds"] = inputs_embeds
            inputs["input_ids"] = None
        else:
            inputs["input_ids"] = input_ids[:, -n:] if n < total else input_ids
        if attention_mask is not None:
            inputs["attention_mask"] = attention_mask
        for key in ("logits_to_keep", "num_logits_to_keep", "output_hidden_states"):
            if kwargs.get(key) is not None:
                inputs[key] = kwargs[key]
        return inputs

    @staticmethod
    def _reorder_cache(past_key_values, beam_idx):
        return past_key_values.reorder_cache(beam_idx)

    @classmethod
    def _supports_default_dynamic_cache(cls):
        return False  # the cache is LaplaceCache, made by forward; never a DynamicCache


def _is_empty_hf_cache(obj):
    """A transformers Cache that holds nothing (some versions hand one to forward): treated as no cache."""
    try:
        return hasattr(obj, "get_seq_length") and int(obj.get_seq_length()) == 0
    except Exception:
        return False


if HAVE_TRANSFORMERS:
    _Output = _HFOutput

    class LaplacePreTrainedModel(_HFPreTrainedModel):
        config_class = LaplaceConfig
        base_model_prefix = "model"
        main_input_name = "input_ids"
        supports_gradient_checkpointing = True
        _no_split_modules = ["LaplaceLayer"]
        _is_stateful = True  # a recurrent state: no assisted decoding, no contrastive search
        _keys_to_ignore_on_load_unexpected = None

        def _init_weights(self, module):
            init_laplace_weights(module, self.config)

    class LaplaceForCausalLM(_LaplaceLMMixin, LaplacePreTrainedModel, _HFGenerationMixin):
        """Laplace language model (SPEC §1) for transformers: see the module docstring."""

        def __init__(self, config):
            super().__init__(config)
            self._build(config)
            self.post_init()

        @classmethod
        def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
            """transformers' from_pretrained plus the Laplace rules: the config must be a laplace one, a local
            checkpoint is checked tensor by tensor against it before loading, and after loading any missing,
            mis-shaped or unexpected tensor is an error naming it (never a silent random init)."""
            path = str(pretrained_model_name_or_path)
            config = kwargs.get("config")
            if os.path.isdir(path):
                if not isinstance(config, LaplaceConfig):
                    config = _load_config(path)
                files = check_model_directory(config, path)
                if is_fp8_directory(path):  # transformers' loader knows no per-row scales: our reader dequantizes
                    model = cls(config)
                    dt = kwargs.get("torch_dtype") or kwargs.get("dtype")
                    if dt is not None and dt != "auto":
                        model = model.to(getattr(torch, dt) if isinstance(dt, str) else dt)
                    model.load_state_dict(read_model_weights(files), strict=True)
                    model.eval()
                    return (model, {}) if kwargs.get("output_loading_info") else model
            want_info = kwargs.pop("output_loading_info", False)
            model, info = super().from_pretrained(pretrained_model_name_or_path, *model_args,
                                                  output_loading_info=True, **kwargs)
            info = info or {}
            problems = [("lacks tensor", sorted(info.get("missing_keys") or [])),
                        ("has unexpected tensor", sorted(info.get("unexpected_keys") or [])),
                        ("has a mis-shaped tensor", sorted(str(m[0]) if isinstance(m, (tuple, list)) else str(m)
                                                           for m in (info.get("mismatched_keys") or [])))]
            for what, names in problems:
                if names:
                    raise LaplaceCheckpointError("checkpoint %s %s%s; missing weights are never initialised at "
                                                 "random" % (what, names[0], " (and %d more)" % (len(names) - 1)
                                                             if len(names) > 1 else ""))
            return (model, info) if want_info else model
else:
    _Output = LaplaceOutput

    class LaplaceForCausalLM(_LaplaceLMMixin, nn.Module):
        """Laplace language model (SPEC §1) on plain PyTorch (transformers is not installed): the same forward,
        cache and tensor names; from_pretrained / save_pretrained read and write our model directories."""

        config_class = LaplaceConfig
        base_model_prefix = "model"

        def __init__(self, config):
            super().__init__()
            self.config = config
            self._build(config)
            self.apply(lambda m: init_laplace_weights(m, config))

        @property
        def device(self):
            return self.model.embed.weight.device

        @property
        def dtype(self):
            return self.model.embed.weight.dtype

        @classmethod
        def from_pretrained(cls, path, config=None, dtype=None, torch_dtype=None, device=None, **kwargs):
            """config.json + model.safetensors (+ the shards of model.safetensors.index.json) of a local directory.
            Every tensor is checked against the config first; nothing is left at random init."""
            config = config if isinstance(config, LaplaceConfig) else _load_config(path)
            tensors = read_model_weights(check_model_directory(config, path))
            model = cls(config)
            dt = dtype or torch_dtype
            if dt is not None:
                model = model.to(getattr(torch, dt) if isinstance(dt, str) else dt)
            model.load_state_dict(tensors, strict=True)  # copies, casting to the parameters' dtype
            model.eval()  # as transformers' from_pretrained
            return model.to(device) if device is not None else model

        def save_pretrained(self, save_directory, **kwargs):
            os.makedirs(save_directory, exist_ok=True)
            self.config.save_pretrained(save_directory)
            write_safetensors(os.path.join(save_directory, SAFETENSORS_NAME), self.state_dict())

        def num_parameters(self):
            return sum(p.numel() for p in self.parameters())
