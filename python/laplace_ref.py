#!/usr/bin/env python3
"""Laplace executable spec: a small PyTorch reference of the model (SPEC §1) and training (SPEC §2).

Runs on torch 1.13 (Debian python3-torch, CPU) and torch 2.x. Dependencies: torch, numpy, stdlib.
Clarity over speed: this file is the definition the C++/CUDA system is tested against.

Conventions the C++ side must match
-----------------------------------
* Decays: lam_h = 1 - 2^(-5-h) as float64; every power lam^n is computed in float64
  (torch.pow on float64) and only then cast to the compute dtype.
* q is pre-scaled: q <- q * scale, scale = 1/sqrt(dk) computed in double, applied in the compute dtype.
* Scalars (lr, betas, clip factors, ...) are computed in Python double; torch rounds them to the
  tensor dtype (fp32) when they multiply a tensor.
* Safetensors files: tensors sorted by name, `__metadata__` first in the header, header padded with
  spaces to a multiple of 8 bytes.
"""
import argparse
import json
import math
import os
import struct
import sys

import numpy as np
import torch
import torch.nn.functional as F

# ----------------------------------------------------------------------------------------------
# Config (SPEC §1)
# ----------------------------------------------------------------------------------------------
_CONFIG_DEFAULTS = dict(conv_size=4, chunk_size=128, norm_eps=1e-5, tie_embeddings=False)
_CONFIG_REQUIRED = ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_k_dim",
                    "head_v_dim", "ffn_size")
_CONFIG_ALIASES = {"num_hidden_layers": "num_layers", "num_attention_heads": "num_heads",
                   "intermediate_size": "ffn_size"}


class Config:
    def __init__(self, **kw):
        d = dict(_CONFIG_DEFAULTS)
        for k, v in kw.items():
            d[_CONFIG_ALIASES.get(k, k)] = v
        missing = [k for k in _CONFIG_REQUIRED if k not in d]
        if missing:
            raise ValueError("config lacks %s" % missing)
        self.V, self.D, self.L = int(d["vocab_size"]), int(d["hidden_size"]), int(d["num_layers"])
        self.H, self.dk, self.dv = int(d["num_heads"]), int(d["head_k_dim"]), int(d["head_v_dim"])
        self.F, self.K, self.C = int(d["ffn_size"]), int(d["conv_size"]), int(d["chunk_size"])
        self.eps, self.tie = float(d["norm_eps"]), bool(d["tie_embeddings"])
        # Optional decay_exponents [H]: lam_h = 1 - 2^(-e_h) instead of e_h = 5 + h (model/config.h).
        self.decay_exponents = None
        if d.get("decay_exponents") is not None:
            e = d["decay_exponents"]
            if not isinstance(e, (list, tuple)) or any(isinstance(x, bool) or not isinstance(x, int) for x in e):
                raise ValueError("config field 'decay_exponents' must be an array of integers")
            if len(e) != self.H:
                raise ValueError("config field 'decay_exponents' has %d entries; num_heads is %d" % (len(e), self.H))
            if any(x < 1 or x > 44 for x in e):
                raise ValueError("config field 'decay_exponents' holds a value outside [1, 44]")
            self.decay_exponents = [int(x) for x in e]

    def to_dict(self):
        return {"model_type": "laplace", "vocab_size": self.V, "hidden_size": self.D,
                "num_layers": self.L, "num_heads": self.H, "head_k_dim": self.dk,
                "head_v_dim": self.dv, "ffn_size": self.F, "conv_size": self.K,
                "chunk_size": self.C, "norm_eps": self.eps, "tie_embeddings": self.tie,
                **({"decay_exponents": list(self.decay_exponents)} if self.decay_exponents else {})}


def load_config(path):
    with open(path) as f:
        return Config(**json.load(f))


# ----------------------------------------------------------------------------------------------
# Safetensors (own implementation; no `safetensors` package)
# ----------------------------------------------------------------------------------------------
_ST_DTYPES = {"F64": (torch.float64, "<f8"), "F32": (torch.float32, "<f4"), "F16": (torch.float16, "<f2"),
              "BF16": (torch.bfloat16, "<i2"), "I64": (torch.int64, "<i8"), "I32": (torch.int32, "<i4"),
              "I16": (torch.int16, "<i2"), "I8": (torch.int8, "<i1"), "U8": (torch.uint8, "<u1")}
_ST_NAMES = {tdt: name for name, (tdt, _) in _ST_DTYPES.items()}


def read_safetensors(path):
    """-> dict name -> tensor (CPU). Layout: u64 LE header length N, N bytes of JSON, then data."""
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n].decode("utf-8"))
    data = memoryview(blob)[8 + n:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        tdt, npdt = _ST_DTYPES[info["dtype"]]
        b, e = info["data_offsets"]
        arr = np.frombuffer(data[b:e], dtype=npdt).copy().reshape(info["shape"])
        t = torch.from_numpy(arr)
        out[name] = t.view(torch.bfloat16) if tdt == torch.bfloat16 else t
    return out


def read_safetensors_metadata(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n).decode("utf-8")).get("__metadata__", {})


def write_safetensors(path, tensors, metadata=None):
    """Atomic write (temp file + os.replace). Tensors sorted by name, contiguous in offset order."""
    meta = {"format": "pt"}
    meta.update({str(k): str(v) for k, v in (metadata or {}).items()})
    header, chunks, off = {"__metadata__": meta}, [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        if t.dtype not in _ST_NAMES:
            raise ValueError("unsupported dtype %s for %s" % (t.dtype, name))
        raw = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()
        raw = raw.astype(raw.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": _ST_NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [off, off + len(raw)]}
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


# ----------------------------------------------------------------------------------------------
# Documents kept apart (varlen). A packed row holds several documents; with them kept apart the mixer
# and the conv restart from a zero state at each document's first token, as flash-linear-attention
# does with cu_seqlens. The per-token form every function below takes (the C++ side's, core/doc_starts.h):
# doc[b, t] = the position in row b of the first token of t's document, or -1 when that document began
# before the row (it continues from the row's initial state and conv window). Valid rows: doc[0] in
# {-1, 0} and doc[t] in {doc[t-1], t}; a document starts at t exactly when doc[t] == t.
# ----------------------------------------------------------------------------------------------
DOCUMENT_SEPARATOR = 2  # "</s>": the shards put one before every document (docs/data.md §3)


def doc_starts_from_separator(tokens, sep=DOCUMENT_SEPARATOR):
    """tokens [B,T] -> doc [B,T] int64: a document starts at every token equal to `sep`; tokens before a
    row's first separator continue the document that was running (-1)."""
    tokens = torch.as_tensor(tokens)
    T = tokens.shape[-1]
    pos = torch.arange(T, dtype=torch.int64, device=tokens.device).expand(tokens.shape)
    marked = torch.where(tokens == sep, pos, torch.full_like(pos, -1))
    return torch.cummax(marked, dim=-1)[0]          # the latest start at or before t


def doc_starts_from_cu_seqlens(cu_seqlens, T):
    """flash-linear-attention's offsets [0, o_1, ..., T] of one packed row of T tokens (document i is
    [o_i, o_{i+1})) -> doc [1, T] int64 (one row, ready for the forward's doc). ValueError, naming the
    value, for fewer than two offsets, a first offset other than 0, one out of order, a repeated one
    (an empty document), one past T, a last other than T."""
    offs = [int(o) for o in torch.as_tensor(cu_seqlens).reshape(-1).tolist()]
    T = int(T)
    if T < 1:
        raise ValueError("documents: row length %d is out of range" % T)
    if len(offs) < 2:
        raise ValueError("documents: need at least two offsets (0 and the row length %d), got %d" % (T, len(offs)))
    if offs[0] != 0:
        raise ValueError("documents: the first offset must be 0, got %d" % offs[0])
    for i in range(1, len(offs)):
        a, b = offs[i - 1], offs[i]
        if b > T:
            raise ValueError("documents: offset %d = %d is past the row's %d tokens" % (i, b, T))
        if b == a:
            raise ValueError("documents: document %d is empty (offsets %d and %d are both %d)" % (i - 1, i - 1, i, a))
        if b < a:
            raise ValueError("documents: offset %d = %d is before offset %d = %d" % (i, b, i - 1, a))
    if offs[-1] != T:
        raise ValueError("documents: the last offset must be the row length %d, got %d" % (T, offs[-1]))
    doc = torch.empty(T, dtype=torch.int64)
    for a, b in zip(offs[:-1], offs[1:]):
        doc[a:b] = a
    return doc[None]


def validate_doc_starts(doc):
    """ValueError, naming the row, the position and the value, unless doc [B,T] is of the form above."""
    doc = torch.as_tensor(doc)
    if doc.dim() != 2:
        raise ValueError("documents: doc must be [B, T], got shape %s" % (tuple(doc.shape),))
    # doc[t] is doc[t-1] or t, with doc[-1] = -1 before the row (so doc[0] is -1 or 0); one vector test,
    # since the trainers check every batch.
    prev = torch.cat([torch.full_like(doc[:, :1], -1), doc[:, :-1]], dim=1)
    bad = ((doc != prev) & (doc != torch.arange(doc.shape[1], device=doc.device))).nonzero()
    if len(bad):
        b, t = (int(x) for x in bad[0])
        raise ValueError("documents: row %d, position %d: document start %d is neither %s" % (
            b, t, int(doc[b, t]), "-1 nor 0" if t == 0 else
            "the previous token's (%d) nor the position itself" % int(doc[b, t - 1])))


def _doc_arg(doc, B, T, device):
    """doc as int64 on `device`, or None when no token starts a document: such rows are one document
    each, and dropping doc then keeps the arithmetic of the plain forms bit for bit."""
    if doc is None:
        return None
    doc = torch.as_tensor(doc).to(device=device, dtype=torch.int64)
    if tuple(doc.shape) != (B, T):
        raise ValueError("documents: doc has shape %s, the tokens are [%d, %d]" % (tuple(doc.shape), B, T))
    if not bool((doc == torch.arange(T, device=device)).any()):
        return None
    return doc


# ----------------------------------------------------------------------------------------------
# GLA mixer, three forms (SPEC §1). q,k: [B,T,H,dk]; v: [B,T,H,dv]; lam: [H] float64;
# S0: [B,H,dk,dv] or None (zeros). Returns (o [B,T,H,dv], S_final [B,H,dk,dv]).
# ----------------------------------------------------------------------------------------------
def head_decays(H, exponents=None):
    """lam_h = 1 - 2^(-e_h), e_h = 5 + h (SPEC §1) unless the config's decay_exponents give them; float64."""
    e = exponents if exponents else [5 + h for h in range(H)]
    return torch.tensor([1.0 - 2.0 ** (-x) for x in e], dtype=torch.float64)


def _init_state(q, v, S0):
    B, _, H, dk = q.shape
    if S0 is None:
        return torch.zeros(B, H, dk, v.shape[-1], dtype=q.dtype, device=q.device)
    return S0.to(q.dtype)


def _keep(mask, x):
    """x where mask, else zero (a where, not a product, so kept values are untouched bit for bit)."""
    return torch.where(mask, x, x.new_zeros(()))


def gla_quadratic(q, k, v, lam, scale, S0=None, doc=None):
    """o_t = lam^{t+1} q_t S0 + sum_{s<=t} lam^{t-s} (q_t.k_s) v_s ;
    S_T = lam^T S0 + sum_s lam^{T-1-s} k_s^T v_s  (q pre-scaled). Tests only.
    doc [B,T] (documents kept apart): a pair (t, s) counts only within one document, S0 reaches only
    the tokens of a document that began before the row (doc -1), and S_T is the last document's."""
    B, T, dt = q.shape[0], q.shape[1], q.dtype
    doc = _doc_arg(doc, B, T, q.device)
    S0 = _init_state(q, v, S0)
    q = q * scale
    lam = lam.to(torch.float64).to(q.device)
    t = torch.arange(T, dtype=torch.float64, device=q.device)
    diff = t[:, None] - t[None, :]                                   # t - s
    Dm = torch.where(diff >= 0, lam[:, None, None] ** diff.clamp(min=0), torch.zeros((), dtype=torch.float64))
    A = torch.einsum("bthk,bshk->bhts", q, k) * Dm.to(dt)            # [B,H,T,T]
    if doc is not None:
        A = _keep((doc[:, :, None] == doc[:, None, :])[:, None], A)
    o = torch.einsum("bhts,bshv->bthv", A, v)
    inter = torch.einsum("bthk,ht,bhkv->bthv", q, (lam[:, None] ** (t + 1)).to(dt), S0)
    if doc is not None:
        inter = _keep((doc < 0)[:, :, None, None], inter)
    o = o + inter
    dk_ = (lam[:, None] ** (T - 1 - t)).to(dt)                       # [H,T]
    S_old, k_in = (lam ** T).to(dt)[None, :, None, None] * S0, k
    if doc is not None:
        last = doc[:, -1]
        S_old = _keep((last < 0)[:, None, None, None], S_old)
        k_in = _keep((doc == last[:, None])[:, :, None, None], k)
    S = S_old + torch.einsum("bshk,hs,bshv->bhkv", k_in, dk_, v)
    return o, S


def gla_recurrent(q, k, v, lam, scale, S0=None, doc=None):
    """S_t = lam S_{t-1} + k_t^T v_t ; o_t = (q_t*scale) S_t  (token t sees itself). Decode form.
    doc [B,T]: S_t = (doc[t] == t ? 0 : lam S_{t-1}) + k_t^T v_t, the restart of each document."""
    doc = _doc_arg(doc, q.shape[0], q.shape[1], q.device)
    S = _init_state(q, v, S0)
    q = q * scale
    lam_c = lam.to(torch.float64).to(q.dtype).to(q.device)[None, :, None, None]
    outs = []
    for t in range(q.shape[1]):
        S_old = lam_c * S
        if doc is not None:
            S_old = _keep((doc[:, t] != t)[:, None, None, None], S_old)
        S = S_old + torch.einsum("bhk,bhv->bhkv", k[:, t], v[:, t])
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    return torch.stack(outs, dim=1), S


def gla_chunked(q, k, v, lam, scale, S0=None, chunk=128, state_dtype=None, doc=None):
    """Chunks of `chunk` tokens (the tail chunk may be shorter, length n). In chunk with entering S:
    o_i = lam^{i+1} q_i S + sum_{j<=i} lam^{i-j} (q_i.k_j) v_j ;  S <- lam^n S + sum_j lam^{n-1-j} k_j^T v_j.
    state_dtype: the dtype S is carried in between chunks (default q's); bf16 training carries it in
    fp32 (SPEC §1: S is fp32), the products stay in q's dtype.
    doc [B,T] (documents kept apart) masks each chunk's terms rather than cutting the row into segments,
    as a chunked kernel does: the intra-chunk pair (i, j) counts iff doc[j] == doc[i]; the inter term
    reaches token i only if its document began before the chunk (doc[i] < chunk start); the state update
    drops lam^n S when a document starts inside the chunk and sums only the tokens of the chunk's last
    document (doc[j] == doc[last])."""
    B, T, dt = q.shape[0], q.shape[1], q.dtype
    doc = _doc_arg(doc, B, T, q.device)
    S = _init_state(q, v, S0)
    sdt = state_dtype or dt
    S = S.to(sdt)
    q = q * scale
    lam = lam.to(torch.float64).to(q.device)
    outs = []
    for c0 in range(0, T, chunk):
        qc, kc, vc = q[:, c0:c0 + chunk], k[:, c0:c0 + chunk], v[:, c0:c0 + chunk]
        n = qc.shape[1]
        dc = doc[:, c0:c0 + n] if doc is not None else None
        i = torch.arange(n, dtype=torch.float64, device=q.device)
        diff = i[:, None] - i[None, :]
        Dm = torch.where(diff >= 0, lam[:, None, None] ** diff.clamp(min=0), torch.zeros((), dtype=torch.float64))
        A = torch.einsum("bihk,bjhk->bhij", qc, kc) * Dm.to(dt)      # intra-chunk, causal incl. diagonal
        if dc is not None:
            A = _keep((dc[:, :, None] == dc[:, None, :])[:, None], A)
        o = torch.einsum("bhij,bjhv->bihv", A, vc)
        inter = torch.einsum("bihk,hi,bhkv->bihv", qc, (lam[:, None] ** (i + 1)).to(dt), S.to(dt))
        if dc is not None:
            inter = _keep((dc < c0)[:, :, None, None], inter)
        o = o + inter
        decay_k = (lam[:, None] ** (n - 1 - i)).to(dt)
        S_old, k_in = (lam ** n).to(sdt)[None, :, None, None] * S, kc
        if dc is not None:
            last = dc[:, -1]
            S_old = _keep((last < c0)[:, None, None, None], S_old)
            k_in = _keep((dc == last[:, None])[:, :, None, None], kc)
        S = S_old + torch.einsum("bjhk,hj,bjhv->bhkv", k_in, decay_k, vc).to(sdt)
        outs.append(o)
    return torch.cat(outs, dim=1), S


def gla_chunked_batched(q, k, v, lam, scale, S0=None, chunk=128, state_dtype=None, doc=None):
    """gla_chunked's arithmetic with every full chunk at once: the intra-chunk products and each chunk's
    state contribution U_n = sum_j lam^{C-1-j} k_j^T v_j are single batched products over the chunks, and
    the state entering chunk n is lam^{Cn} S0 + sum_{m<n} lam^{C(n-1-m)} U_m (one more product, in
    state_dtype). A shorter tail is one more chunk of its own length. Same result as gla_chunked up to the
    order of the state sums; far fewer kernels, which is what the GPU reference trainer needs.
    doc [B,T]: gla_chunked's masks; in the sum for the entering state, U_m (and S0) count only if no
    document starts in a chunk between it and chunk n, since such a start zeroes the state there."""
    B, T, H, dk = q.shape
    dv, dt = v.shape[-1], q.dtype
    sdt = state_dtype or dt
    doc = _doc_arg(doc, B, T, q.device)
    S = _init_state(q, v, S0).to(sdt)
    lam = lam.to(torch.float64).to(q.device)
    q = q * scale

    def chunks(t0, N, C, S):  # N chunks of C tokens from t0, entering state S: (o [B,N*C,H,dv], S out)
        qc = q[:, t0:t0 + N * C].reshape(B, N, C, H, dk)
        kc = k[:, t0:t0 + N * C].reshape(B, N, C, H, dk)
        vc = v[:, t0:t0 + N * C].reshape(B, N, C, H, dv)
        i = torch.arange(C, dtype=torch.float64, device=q.device)
        diff = i[:, None] - i[None, :]
        Dm = torch.where(diff >= 0, lam[:, None, None] ** diff.clamp(min=0), torch.zeros((), dtype=torch.float64))
        A = torch.einsum("bnihk,bnjhk->bnhij", qc, kc) * Dm.to(dt)
        n = torch.arange(N, dtype=torch.float64, device=q.device)
        gap = n[:, None] - 1 - n[None, :]                            # n - 1 - m
        W = torch.where(gap >= 0, lam[:, None, None] ** (C * gap.clamp(min=0)), torch.zeros((), dtype=torch.float64))
        W0 = lam[:, None] ** (C * n)                                 # [H,N]: S0's weight entering chunk n
        if doc is None:
            o = torch.einsum("bnhij,bnjhv->bnihv", A, vc)
            U = torch.einsum("bnjhk,hj,bnjhv->bnhkv", kc, (lam[:, None] ** (C - 1 - i)).to(dt), vc).to(sdt)
            S_in = torch.einsum("hnm,bmhkv->bnhkv", W.to(sdt), U) + \
                torch.einsum("hn,bhkv->bnhkv", W0.to(sdt), S)        # entering chunk n
            o = o + torch.einsum("bnihk,hi,bnhkv->bnihv", qc, (lam[:, None] ** (i + 1)).to(dt), S_in.to(dt))
            S = (lam ** C).to(sdt)[None, :, None, None] * S_in[:, -1] + U[:, -1]
            return o.reshape(B, N * C, H, dv), S
        d = doc[:, t0:t0 + N * C].reshape(B, N, C)
        c0 = t0 + C * torch.arange(N, device=q.device)               # each chunk's first position
        A = _keep((d[:, :, :, None] == d[:, :, None, :])[:, :, None], A)
        o = torch.einsum("bnhij,bnjhv->bnihv", A, vc)
        k_in = _keep((d == d[:, :, -1:])[..., None, None], kc)       # the chunk's last document only
        U = torch.einsum("bnjhk,hj,bnjhv->bnhkv", k_in, (lam[:, None] ** (C - 1 - i)).to(dt), vc).to(sdt)
        reset = d[:, :, -1] >= c0                                    # [B,N]: a document starts in chunk n
        upto = torch.cumsum(reset.long(), 1)                         # starts in chunks 0..n
        before = upto - reset.long()                                 # starts in chunks 0..n-1
        # U_m reaches chunk n iff no start in chunks m+1..n-1, i.e. before[n] == upto[m]
        Wb = _keep((before[:, :, None] == upto[:, None, :])[:, None], W[None])       # [B,H,N,M]
        W0b = _keep((before == 0)[:, None], W0[None])                                # [B,H,N]
        S_in = torch.einsum("bhnm,bmhkv->bnhkv", Wb.to(sdt), U) + torch.einsum("bhn,bhkv->bnhkv", W0b.to(sdt), S)
        inter = torch.einsum("bnihk,hi,bnhkv->bnihv", qc, (lam[:, None] ** (i + 1)).to(dt), S_in.to(dt))
        o = o + _keep((d < c0[:, None])[..., None, None], inter)
        S_old = _keep(~reset[:, -1, None, None, None], (lam ** C).to(sdt)[None, :, None, None] * S_in[:, -1])
        S = S_old + U[:, -1]
        return o.reshape(B, N * C, H, dv), S

    N, tail = T // chunk, T % chunk
    outs = []
    if N:
        o, S = chunks(0, N, chunk, S)
        outs.append(o)
    if tail:
        o, S = chunks(N * chunk, 1, tail, S)
        outs.append(o)
    if not outs:
        return q.new_zeros(B, 0, H, dv), S
    return torch.cat(outs, dim=1), S


# ----------------------------------------------------------------------------------------------
# Model (SPEC §1)
# ----------------------------------------------------------------------------------------------
def conv_silu(u, w, win, doc=None):
    """Causal depthwise conv and its SiLU: c_t = SiLU(sum_j w[:,j] * u_{t-K+1+j}), u [B,T,D], w [D,K];
    inputs before the row come from win [B,K,D] (its last K-1 rows; zeros for a new sequence).
    Returns (c [B,T,D], the new window: the last K inputs).
    doc [B,T] (documents kept apart): token t reads no input u_p with p < doc[t] (zeros there; doc -1
    reads the window), and the new window holds zeros before the start of the row's last document, so
    that a continuation carries on that document as if it had begun from a zero window."""
    B, T, _ = u.shape
    K = w.shape[1]
    doc = _doc_arg(doc, B, T, u.device)
    ext = torch.cat([win.to(u.dtype), u], dim=1)                     # [B, K+T, D]; ext[K+t] = u_t
    if doc is None:
        cv = sum(w[:, j] * ext[:, 1 + j:1 + j + T] for j in range(K))
        return F.silu(cv), ext[:, -K:]
    # First position each token may read: its document's start, or anything (-K) for doc -1.
    first = torch.where(doc < 0, torch.full_like(doc, -K), doc)     # [B,T]
    t = torch.arange(T, device=u.device)
    cv = sum(w[:, j] * _keep((t - K + 1 + j >= first)[..., None], ext[:, 1 + j:1 + j + T]) for j in range(K))
    p = torch.arange(T - K, T, device=u.device)                      # the window's positions
    return F.silu(cv), _keep((p >= first[:, -1:])[..., None], ext[:, -K:])


def param_shapes(cfg):
    """Canonical names and shapes, in canonical (model) order; this is also the init RNG order."""
    c = cfg
    out = [("model.embed.weight", (c.V, c.D))]
    for i in range(c.L):
        p = "model.layers.%d." % i
        out += [(p + "norm1.weight", (c.D,)), (p + "norm1.bias", (c.D,)), (p + "conv.weight", (c.D, c.K)),
                (p + "wqkvg.weight", (c.H * (2 * c.dk + 2 * c.dv), c.D)), (p + "onorm.weight", (c.dv,)),
                (p + "wo.weight", (c.D, c.H * c.dv)), (p + "norm2.weight", (c.D,)), (p + "norm2.bias", (c.D,)),
                (p + "w12.weight", (2 * c.F, c.D)), (p + "w3.weight", (c.D, c.F))]
    out += [("model.norm.weight", (c.D,)), ("model.norm.bias", (c.D,))]
    if not c.tie:
        out.append(("lm_head.weight", (c.V, c.D)))
    return out


def init_params(cfg, seed):
    """Deterministic init. RNG: numpy.random.RandomState(seed).standard_normal(shape) (float64, then
    scaled and cast to fp32), drawn in the canonical order of param_shapes() for random tensors only.
    Matrices and embeddings/head: N(0, 0.02); wo and w3: N(0, 0.02/sqrt(2L)); conv: N(0, 1/sqrt(K));
    LayerNorm weights 1, biases 0; onorm 1."""
    rng = np.random.RandomState(seed)
    out = {}
    for name, shape in param_shapes(cfg):
        if name.endswith((".norm1.weight", ".norm2.weight", "norm.weight", "onorm.weight")):
            a = np.ones(shape)
        elif name.endswith(".bias"):
            a = np.zeros(shape)
        else:
            std = 0.02
            if name.endswith(("wo.weight", "w3.weight")):
                std = 0.02 / math.sqrt(2 * cfg.L)
            elif name.endswith("conv.weight"):
                std = 1.0 / math.sqrt(cfg.K)
            a = rng.standard_normal(shape) * std
        out[name] = torch.from_numpy(np.asarray(a, dtype=np.float32))
    return out


class Laplace(torch.nn.Module):
    """Parameters live in self.p (a ParameterDict keyed by canonical name with '.' -> '/')."""

    def __init__(self, cfg, params=None):
        super().__init__()
        self.cfg = cfg
        params = params if params is not None else init_params(cfg, 0)
        self.p = torch.nn.ParameterDict()
        for name, shape in param_shapes(cfg):
            t = params[name]
            assert tuple(t.shape) == tuple(shape), (name, t.shape, shape)
            self.p[name.replace(".", "/")] = torch.nn.Parameter(t.detach().clone().float())

    def named(self):
        """-> list of (canonical name, Parameter) in canonical order."""
        return [(n, self.p[n.replace(".", "/")]) for n, _ in param_shapes(self.cfg)]

    def state_dict_canonical(self):
        return {n: t.detach().clone() for n, t in self.named()}

    # None, or a dtype (torch.bfloat16) every parameter is rounded to where the forward reads it, the
    # gradient passing straight through to the fp32 parameter: the C++ bf16 model's policy (bf16 copies of
    # all weights, fp32 masters), where autocast rounds only the operands of matrix products.
    round_params = None

    def _w(self, name):
        w = self.p[name.replace(".", "/")]
        if self.round_params is None:
            return w
        return w + (w.to(self.round_params).float() - w).detach()

    def empty_state(self, B, dtype=None):
        w = self._w("model.embed.weight")
        c, dt, dev = self.cfg, dtype or w.dtype, w.device
        return [(torch.zeros(B, c.H, c.dk, c.dv, dtype=dt, device=dev), torch.zeros(B, c.K, c.D, dtype=dt, device=dev))
                for _ in range(c.L)]

    def forward(self, tokens, state=None, mixer="chunked", chunk=None, state_dtype=None, doc=None,
                document_separator=None):
        """tokens [B,T] int64; state: list over layers of (gla_state [B,H,dk,dv], conv_window [B,K,D])
        or None (zeros). Returns (logits [B,T,V], new state). state_dtype: see gla_chunked (under bf16
        autocast, fp32 keeps the GLA state and the output RMSNorm in fp32 as the CUDA path does).
        Documents kept apart: doc [B,T] (the form above), or document_separator (2, "</s>") to derive it
        from the tokens; every layer's mixer and conv restart from zero at each document start, and the
        returned state continues the last document. Neither: each row is one document."""
        c = self.cfg
        B, T = tokens.shape
        chunk = chunk or c.C
        if document_separator is not None:
            if doc is not None:
                raise ValueError("documents: give doc or document_separator, not both")
            doc = doc_starts_from_separator(tokens, document_separator)
        if doc is not None:
            validate_doc_starts(doc)
            doc = _doc_arg(doc, B, T, tokens.device)
        lam, scale = head_decays(c.H, c.decay_exponents), 1.0 / math.sqrt(c.dk)
        x = F.embedding(tokens, self._w("model.embed.weight"))
        dt = x.dtype
        if state is None:
            state = self.empty_state(B, dt)
        new_state = []
        for li in range(c.L):
            p = "model.layers.%d." % li
            S0, win = state[li]
            # --- token mixer ---
            u = F.layer_norm(x, (c.D,), self._w(p + "norm1.weight"), self._w(p + "norm1.bias"), c.eps)
            cv, new_win = conv_silu(u, self._w(p + "conv.weight"), win.to(dt), doc)
            qkvg = cv @ self._w(p + "wqkvg.weight").t()
            hk, hv = c.H * c.dk, c.H * c.dv
            q = qkvg[..., :hk].reshape(B, T, c.H, c.dk)
            k = qkvg[..., hk:2 * hk].reshape(B, T, c.H, c.dk)
            v = qkvg[..., 2 * hk:2 * hk + hv].reshape(B, T, c.H, c.dv)
            g = qkvg[..., 2 * hk + hv:].reshape(B, T, c.H, c.dv)
            if mixer == "chunked":
                o, S = gla_chunked(q, k, v, lam, scale, S0, chunk, state_dtype, doc)
            elif mixer == "batched":
                o, S = gla_chunked_batched(q, k, v, lam, scale, S0, chunk, state_dtype, doc)
            elif mixer == "recurrent":
                o, S = gla_recurrent(q, k, v, lam, scale, S0, doc)
            elif mixer == "quadratic":
                o, S = gla_quadratic(q, k, v, lam, scale, S0, doc)
            else:
                raise ValueError(mixer)
            # per-head RMSNorm (weight [dv] shared by heads) times SiLU gate
            if state_dtype is not None:
                o = o.to(state_dtype)
            o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + c.eps) * self._w(p + "onorm.weight")
            y = (o * F.silu(g)).reshape(B, T, hv)
            x = x + y @ self._w(p + "wo.weight").t()
            # --- channel mixer (SwiGLU-style) ---
            z = F.layer_norm(x, (c.D,), self._w(p + "norm2.weight"), self._w(p + "norm2.bias"), c.eps)
            ab = z @ self._w(p + "w12.weight").t()
            x = x + (F.silu(ab[..., :c.F]) * ab[..., c.F:]) @ self._w(p + "w3.weight").t()
            new_state.append((S, new_win))
        x = F.layer_norm(x, (c.D,), self._w("model.norm.weight"), self._w("model.norm.bias"), c.eps)
        head = self._w("model.embed.weight") if c.tie else self._w("lm_head.weight")
        return x @ head.t(), new_state


def load_model(cfg, ckpt, dtype="f32"):
    m = Laplace(cfg, read_safetensors(ckpt))
    return m.double() if dtype == "f64" else m


def loss_fn(logits, y):
    """Mean cross-entropy over the B*T targets."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def state_to_tensors(state):
    out = {}
    for i, (S, w) in enumerate(state):
        out["layers.%d.gla_state" % i], out["layers.%d.conv_window" % i] = S, w
    return out


def state_from_tensors(t, L, dtype):
    return [(t["layers.%d.gla_state" % i].to(dtype), t["layers.%d.conv_window" % i].to(dtype)) for i in range(L)]


# ----------------------------------------------------------------------------------------------
# Newton–Schulz (SPEC §2)
# ----------------------------------------------------------------------------------------------
NS_COEFFS = (3.4445, -4.7750, 2.0315)


def newton_schulz(G, steps=5, eps=1e-7, mode="fp32"):
    """X = G / (||G||_F + eps) (norm summed in float64, result rounded to fp32); work on X^T if rows > cols;
    `steps` times: A = X X^T; B = b A + c (A A); X = a X + B X. mode 'fp32': all fp32;
    mode 'bf16': X cast to bf16 after normalisation, every product in bf16 (Muon reference style).
    Returns fp32, same shape as G."""
    a, b, c = NS_COEFFS
    G32 = G.float()
    nrm = float(G32.double().pow(2).sum().sqrt())
    X = G32 / (nrm + eps)
    tr = G.shape[0] > G.shape[1]
    if tr:
        X = X.t()
    if mode == "bf16":
        X = X.bfloat16()
    elif mode != "fp32":
        raise ValueError(mode)
    for _ in range(steps):
        A = X @ X.t()
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    X = X.float()
    return (X.t() if tr else X).contiguous()


# ----------------------------------------------------------------------------------------------
# Optimizers (SPEC §2). All updates in place on fp32 master weights.
# ----------------------------------------------------------------------------------------------
BODY_SUFFIXES = ("wqkvg.weight", "wo.weight", "w12.weight", "w3.weight")


def is_body(name):
    return name.startswith("model.layers.") and name.endswith(BODY_SUFFIXES)


def muon_blocks(name, cfg, fused=False):
    """Row-block sizes orthogonalised separately: wqkvg -> [H dk, H dk, H dv, H dv] (q,k,v,g);
    w12 -> [F, F] (a,b); wo, w3 whole. fused=True: whole matrix."""
    if not fused and name.endswith("wqkvg.weight"):
        return [cfg.H * cfg.dk, cfg.H * cfg.dk, cfg.H * cfg.dv, cfg.H * cfg.dv]
    if not fused and name.endswith("w12.weight"):
        return [cfg.F, cfg.F]
    return None


def muon_scale(rows, cols, scale_mode="rms"):
    """'rms': 0.2*sqrt(max(rows, cols)) ; 'shape': sqrt(max(1, rows/cols))  (shape of the block)."""
    if scale_mode == "rms":
        return 0.2 * math.sqrt(max(rows, cols))
    if scale_mode == "shape":
        return math.sqrt(max(1.0, rows / cols))
    raise ValueError(scale_mode)


def muon_update(W, G, M, lr, wd, momentum=0.95, blocks=None, scale_mode="rms", ns_mode="fp32", ns_steps=5):
    """Muon, in place on W and M:
        M <- mu M + G ;  U = G + mu M   (Nesterov, with the new M)
        for each row block U_b of U (blocks=None: whole): O_b = newton_schulz(U_b), s_b = muon_scale(block shape)
        W <- W * (1 - lr*wd) ;  W_b <- W_b - (lr*s_b) * O_b
    (the factors (1 - lr*wd) and lr*s_b are computed in double, applied in fp32)."""
    M.mul_(momentum).add_(G)
    U = G + momentum * M
    W.mul_(1.0 - lr * wd)
    r0 = 0
    for rb in (blocks or [W.shape[0]]):
        Ub = U[r0:r0 + rb]
        O = newton_schulz(Ub, steps=ns_steps, mode=ns_mode).to(W.dtype)
        W[r0:r0 + rb].add_(O, alpha=-(lr * muon_scale(rb, W.shape[1], scale_mode)))
        r0 += rb
    assert r0 == W.shape[0]


def adamw_wd(name, wd):
    """Weight decay of AdamW params: wd for model.embed.weight and lm_head.weight; 0 for norms, biases, conv, onorm."""
    return wd if name in ("model.embed.weight", "lm_head.weight") else 0.0


def adamw_update(W, G, m, v, t, lr, wd, beta1=0.9, beta2=0.95, eps=1e-8):
    """AdamW, in place, t = 1-based count of applied steps:
        m <- b1 m + (1-b1) G ;  v <- b2 v + (1-b2) G^2
        mh = m / (1 - b1^t) ;   vh = v / (1 - b2^t)
        W <- W * (1 - lr*wd) ;  W <- W - lr * mh / (sqrt(vh) + eps)"""
    m.mul_(beta1).add_(G, alpha=1.0 - beta1)
    v.mul_(beta2).addcmul_(G, G, value=1.0 - beta2)
    mh = m / (1.0 - beta1 ** t)
    vh = v / (1.0 - beta2 ** t)
    W.mul_(1.0 - lr * wd)
    W.add_(mh / (vh.sqrt() + eps), alpha=-lr)


def lr_at(step, total, lr, warmup=0, schedule="cosine", min_lr_frac=0.1, decay_frac=0.2):
    """0-based step s of `total`. s < warmup: lr*(s+1)/warmup. Then, with min_lr = lr*min_lr_frac:
    cosine:   p = (s-warmup)/max(1, total-1-warmup);  min_lr + 0.5(lr-min_lr)(1+cos(pi p))
    wsd:      n = max(1, floor(decay_frac*total)); d0 = max(warmup, total - n); s < d0: lr;
              else p = (s-d0+1)/(total-d0);  lr - (lr-min_lr) p   (decay steps give lr - (lr-min_lr)*k/(total-d0), k=1..)
    constant: lr.   (The last step, s = total-1, gets exactly min_lr for cosine and wsd.)"""
    if step < warmup:
        return lr * (step + 1) / warmup
    min_lr = lr * min_lr_frac
    if schedule == "constant":
        return lr
    if schedule == "cosine":
        p = (step - warmup) / max(1, total - 1 - warmup)
        return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * min(p, 1.0)))
    if schedule == "wsd":
        d0 = max(warmup, total - max(1, int(math.floor(decay_frac * total))))
        if step < d0:
            return lr
        p = (step - d0 + 1) / (total - d0)
        return lr - (lr - min_lr) * min(p, 1.0)
    raise ValueError(schedule)


def clip_grads(grads, max_norm):
    """norm = sqrt(sum over params of sum g^2) in float64. Non-finite -> returns (norm, False): skip the step.
    If max_norm > 0 and norm > max_norm: every g *= max_norm/(norm + 1e-6). Returns (norm, True)."""
    norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
    if not math.isfinite(norm):
        return norm, False
    if max_norm > 0 and norm > max_norm:
        f = max_norm / (norm + 1e-6)
        for g in grads:
            g.mul_(f)
    return norm, True


class Optimizer:
    """Muon for body matrices, AdamW for the rest; one step = clip, then update (or skip on non-finite norm)."""

    def __init__(self, model, wd=0.1, max_grad_norm=1.0, momentum=0.95, fused=False, scale_mode="rms",
                 ns_mode="fp32", muon_lr_mult=1.0, beta1=0.9, beta2=0.95, eps=1e-8):
        self.model, self.cfg = model, model.cfg
        self.wd, self.max_grad_norm, self.momentum, self.fused = wd, max_grad_norm, momentum, fused
        self.scale_mode, self.ns_mode, self.muon_lr_mult = scale_mode, ns_mode, muon_lr_mult
        self.beta1, self.beta2, self.eps = beta1, beta2, eps
        self.state = {n: ([torch.zeros_like(p)] if is_body(n) else [torch.zeros_like(p), torch.zeros_like(p)])
                      for n, p in model.named()}
        self.t = 0  # applied AdamW steps

    @torch.no_grad()
    def step(self, lr):
        named = self.model.named()
        grads = [p.grad for _, p in named]
        norm, ok = clip_grads(grads, self.max_grad_norm)
        if not ok:
            return norm, False
        self.t += 1
        for (n, p), g in zip(named, grads):
            if is_body(n):
                muon_update(p.data, g, self.state[n][0], lr * self.muon_lr_mult, self.wd, self.momentum,
                            muon_blocks(n, self.cfg, self.fused), self.scale_mode, self.ns_mode)
            else:
                m, v = self.state[n]
                adamw_update(p.data, g, m, v, self.t, lr, adamw_wd(n, self.wd), self.beta1, self.beta2, self.eps)
        return norm, True


# ----------------------------------------------------------------------------------------------
# Data (llm.c shard format) and training
# ----------------------------------------------------------------------------------------------
SHARD_MAGIC = 20240520


def read_shard(path):
    """Header: 256 int32 (magic 20240520, version, token count, ...); tokens uint16 (v1) or uint32 (v2)."""
    with open(path, "rb") as f:
        hdr = np.frombuffer(f.read(1024), dtype="<i4")
        if hdr[0] != SHARD_MAGIC:
            raise ValueError("bad shard magic %d" % hdr[0])
        dt = {1: "<u2", 2: "<u4"}[int(hdr[1])]
        n = int(hdr[2])
        toks = np.frombuffer(f.read(), dtype=dt)[:n]
    if len(toks) != n:
        raise ValueError("shard truncated")
    return torch.from_numpy(toks.astype(np.int64))


def write_shard(path, tokens, version=1):
    hdr = np.zeros(256, dtype="<i4")
    hdr[0], hdr[1], hdr[2] = SHARD_MAGIC, version, len(tokens)
    with open(path, "wb") as f:
        f.write(hdr.tobytes())
        f.write(np.asarray(tokens, dtype="<u2" if version == 1 else "<u4").tobytes())


class DataLoader:
    """llm.c-style, no shuffle: p = 0; each batch x = tok[p:p+BT], y = tok[p+1:p+BT+1];
    p += BT; if p + BT + 1 > n: p = 0."""

    def __init__(self, tokens, B, T):
        if len(tokens) < B * T + 1:
            raise ValueError("shard has %d tokens, need >= %d" % (len(tokens), B * T + 1))
        self.tok, self.B, self.T, self.p = tokens, B, T, 0

    def next_batch(self):
        B, T, p = self.B, self.T, self.p
        x = self.tok[p:p + B * T].reshape(B, T)
        y = self.tok[p + 1:p + B * T + 1].reshape(B, T)
        self.p += B * T
        if self.p + B * T + 1 > len(self.tok):
            self.p = 0
        return x, y


def train(cfg, params, tokens, steps, B, T, lr, warmup=0, schedule="cosine", min_lr_frac=0.1, decay_frac=0.2,
          wd=0.1, max_grad_norm=1.0, dtype="f32", mixer="chunked", chunk=None, log=None, document_separator=None,
          **opt_kw):
    """Reproduces `laplace train` on CPU. Per step s (0-based): lr_s = lr_at(s); forward on the next batch;
    loss = mean CE; backward; Optimizer.step (clip / skip / Muon + AdamW). document_separator: documents
    kept apart, each starting at that token (Laplace.forward).
    Returns (history: list of dicts {step, loss, grad_norm, lr, skipped}, final params dict)."""
    model = Laplace(cfg, params)
    if dtype == "f64":
        model = model.double()
    opt = Optimizer(model, wd=wd, max_grad_norm=max_grad_norm, **opt_kw)
    dl = DataLoader(tokens, B, T)
    hist = []
    for s in range(steps):
        lr_s = lr_at(s, steps, lr, warmup, schedule, min_lr_frac, decay_frac)
        x, y = dl.next_batch()
        model.zero_grad(set_to_none=True)
        logits, _ = model(x, mixer=mixer, chunk=chunk, document_separator=document_separator)
        loss = loss_fn(logits, y)
        loss.backward()
        norm, ok = opt.step(lr_s)
        rec = dict(step=s, loss=float(loss.detach()), grad_norm=norm, lr=lr_s, skipped=not ok)
        hist.append(rec)
        if log:
            log("step %d loss %.6f grad_norm %.6f lr %.6e%s" % (s, rec["loss"], norm, lr_s,
                                                                 " SKIPPED (non-finite grad)" if not ok else ""))
    return hist, model.state_dict_canonical()


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------
def _parse_tokens(s):
    rows = [[int(t) for t in r.split(",") if t.strip()] for r in s.split(";") if r.strip()]
    if len({len(r) for r in rows}) != 1:
        raise ValueError("all token rows must have the same length")
    return torch.tensor(rows, dtype=torch.int64)


def _tdt(name):
    return torch.float64 if name == "f64" else torch.float32


def cmd_init(a):
    cfg = load_config(a.config)
    write_safetensors(a.out, init_params(cfg, a.seed), {"config": json.dumps(cfg.to_dict()), "seed": a.seed})


def cmd_forward(a):
    cfg = load_config(a.config)
    model = load_model(cfg, a.ckpt, a.dtype)
    if a.tokens_file:
        tok = read_shard(a.tokens_file)
        B, T = a.batch, a.seq
        tok = tok[:B * T].reshape(B, T)
    else:
        tok = _parse_tokens(a.tokens)
    state = None
    if a.state_in:
        state = state_from_tensors(read_safetensors(a.state_in), cfg.L, _tdt(a.dtype))
    with torch.no_grad():
        logits, st = model(tok, state=state, mixer=a.mixer, chunk=a.chunk, document_separator=a.document_separator)
        out = {"logits": logits, "tokens": tok}
        if tok.shape[1] > 1:
            out["loss"] = loss_fn(logits[:, :-1], tok[:, 1:]).reshape(1)
            print("loss %.8f" % float(out["loss"]))
    write_safetensors(a.out, out)
    if a.state_out:
        write_safetensors(a.state_out, state_to_tensors(st))


def cmd_grad(a):
    cfg = load_config(a.config)
    model = load_model(cfg, a.ckpt, a.dtype)
    x, y = DataLoader(read_shard(a.tokens_file), a.batch, a.seq).next_batch()
    state = None
    if a.initial_state:
        state = state_from_tensors(read_safetensors(a.initial_state), cfg.L, _tdt(a.dtype))
        state = [(S.requires_grad_(), w.requires_grad_()) for S, w in state]
    logits, _ = model(x, state=state, mixer=a.mixer, chunk=a.chunk, document_separator=a.document_separator)
    loss = loss_fn(logits, y)
    loss.backward()
    out = {n: p.grad for n, p in model.named()}
    out["loss"] = loss.detach().reshape(1)
    if state is not None:
        out.update({"grad." + k: t.grad for k, t in state_to_tensors(state).items()})
    print("loss %.8f" % float(loss.detach()))
    write_safetensors(a.out, out)


def cmd_generate(a):
    cfg = load_config(a.config)
    model = load_model(cfg, a.ckpt, a.dtype)
    ids = generate(model, [int(t) for t in a.prompt.split(",") if t.strip()], a.steps)
    print(",".join(str(i) for i in ids))


@torch.no_grad()
def generate(model, prompt, steps):
    """Greedy: chunked prefill of the prompt, then recurrent single-token steps. argmax ties -> lowest id."""
    logits, st = model(torch.tensor([prompt], dtype=torch.int64), mixer="chunked")
    out = []
    for i in range(steps):
        nxt = int(torch.argmax(logits[0, -1]))
        out.append(nxt)
        if i + 1 < steps:
            logits, st = model(torch.tensor([[nxt]], dtype=torch.int64), state=st, mixer="recurrent")
    return out


def cmd_train(a):
    cfg = load_config(a.config)
    hist, params = train(cfg, read_safetensors(a.ckpt), read_shard(a.data), a.steps, a.batch, a.seq, a.lr,
                         warmup=a.warmup, schedule=a.schedule, min_lr_frac=a.min_lr_frac, decay_frac=a.decay_frac,
                         wd=a.wd, max_grad_norm=a.max_grad_norm, dtype=a.dtype, mixer=a.mixer, chunk=a.chunk,
                         log=print, momentum=a.momentum, fused=a.muon_fused, scale_mode=a.muon_scale,
                         ns_mode=a.ns_mode, muon_lr_mult=a.muon_lr_mult, document_separator=a.document_separator)
    if a.out_losses:
        with open(a.out_losses, "w") as f:
            f.writelines("%.9g\n" % r["loss"] for r in hist)
    if a.out:
        write_safetensors(a.out, {n: t.float() for n, t in params.items()})


def cmd_ns(a):
    G = read_safetensors(a.inp)["G"]
    write_safetensors(a.out, {"O": newton_schulz(G, steps=a.steps, mode=a.mode)})


def main(argv=None):
    ap = argparse.ArgumentParser(prog="laplace_ref", description="Laplace PyTorch reference (SPEC §1, §2)")
    sub = ap.add_subparsers(dest="cmd", required=True)

    def model_args(p):
        p.add_argument("--config", required=True)
        p.add_argument("--ckpt", required=True)
        p.add_argument("--dtype", choices=["f32", "f64"], default="f32")
        p.add_argument("--mixer", choices=["chunked", "batched", "recurrent", "quadratic"], default="chunked")
        p.add_argument("--chunk", type=int, default=None, help="chunk size (default: config chunk_size)")

    def doc_arg(p):
        p.add_argument("--document-separator", type=int, default=None,
                       help="keep documents apart, each starting at this token (2, </s>); "
                            "default: each row is one document")

    p = sub.add_parser("init"); p.set_defaults(fn=cmd_init)
    p.add_argument("--config", required=True); p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)

    p = sub.add_parser("forward"); p.set_defaults(fn=cmd_forward); model_args(p); doc_arg(p)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--tokens", help='rows separated by ";", ids by ",": "1,2,3;4,5,6"')
    g.add_argument("--tokens-file", help="llm.c shard; first batch*seq tokens")
    p.add_argument("--batch", type=int, default=1); p.add_argument("--seq", type=int, default=64)
    p.add_argument("--state-in"); p.add_argument("--state-out")
    p.add_argument("--out", required=True)

    p = sub.add_parser("grad"); p.set_defaults(fn=cmd_grad); model_args(p); doc_arg(p)
    p.add_argument("--tokens-file", required=True)
    p.add_argument("--batch", type=int, required=True); p.add_argument("--seq", type=int, required=True)
    p.add_argument("--initial-state"); p.add_argument("--out", required=True)

    p = sub.add_parser("generate"); p.set_defaults(fn=cmd_generate); model_args(p)
    p.add_argument("--prompt", required=True); p.add_argument("--steps", type=int, default=64)

    p = sub.add_parser("train"); p.set_defaults(fn=cmd_train)
    p.add_argument("--config", required=True); p.add_argument("--ckpt", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--batch", type=int, required=True); p.add_argument("--seq", type=int, required=True)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--schedule", choices=["cosine", "wsd", "constant"], default="cosine")
    p.add_argument("--min-lr-frac", type=float, default=0.1)
    p.add_argument("--decay-frac", type=float, default=0.2)
    p.add_argument("--wd", type=float, default=0.1)
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="<= 0 disables clipping")
    p.add_argument("--momentum", type=float, default=0.95)
    p.add_argument("--muon-fused", action="store_true")
    p.add_argument("--muon-scale", choices=["rms", "shape"], default="rms")
    p.add_argument("--muon-lr-mult", type=float, default=1.0)
    p.add_argument("--ns-mode", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--dtype", choices=["f32", "f64"], default="f32")
    p.add_argument("--mixer", choices=["chunked", "batched", "recurrent", "quadratic"], default="chunked")
    p.add_argument("--chunk", type=int, default=None)
    doc_arg(p)
    p.add_argument("--out-losses"); p.add_argument("--out", help="final checkpoint")

    p = sub.add_parser("ns"); p.set_defaults(fn=cmd_ns)
    p.add_argument("--in", dest="inp", required=True); p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=5); p.add_argument("--mode", choices=["fp32", "bf16"], default="fp32")

    a = ap.parse_args(argv)
    a.fn(a)


if __name__ == "__main__":
    main()
