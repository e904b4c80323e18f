#!/usr/bin/env python3
"""The PyTorch reference trainer at real scale: the executable spec's model and optimizer
(laplace_ref.Laplace, laplace_ref.Optimizer, laplace_ref.lr_at) run as `laplace train` runs, on
llm.c token shards, so that the two loss curves can be compared step by step (docs/quality.md).

What it shares with `laplace train` (and what a parity run must pass to both):
  * the initial weights: --init, a safetensors file (`laplace_ref.py init`), given to
    `laplace train --init` too;
  * the data order: `laplace train --no-shuffle` (sequential mode of text/data_loader.h, rank 0 of 1):
    per shard, batch i reads rows at i*B*T + b*T; a shard is left when the next batch would not fit
    (p + B*T + 1 > n); after the last shard, back to the first;
  * per step: grad_accum micro-batches of B rows, loss = mean over the micro-batch's targets,
    gradients averaged over micro-batches; then clip, Muon + AdamW (or skip on a non-finite norm);
  * validation: the first --eval-batches batches of the validation shards read the same way, mean loss.
Precision: --amp bf16 runs the forward under torch.autocast(bfloat16) with fp32 master weights, the GLA
state and the output RMSNorm in fp32, and Newton–Schulz in bf16 (--ns-mode), as the CUDA path does.
Writes metrics.jsonl in the format of `laplace train` (one line per step; validation lines
{"step", "val_loss"}), appending, and resumes from --out's reference_checkpoint.pt when asked.
"""
import argparse
import glob
import json
import math
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import laplace_ref as ref  # noqa: E402


def read_shard_tokens(path):
    """An llm.c shard as a numpy array (uint16 or uint32), memory-mapped."""
    hdr = np.fromfile(path, dtype="<i4", count=256)
    if len(hdr) < 256 or hdr[0] != ref.SHARD_MAGIC:
        raise SystemExit("reference_trainer: %s is not an llm.c token shard" % path)
    dt = {1: "<u2", 2: "<u4"}.get(int(hdr[1]))
    if dt is None:
        raise SystemExit("reference_trainer: %s: unknown shard version %d" % (path, hdr[1]))
    n = int(hdr[2])
    toks = np.memmap(path, dtype=dt, mode="r", offset=1024, shape=(n,))
    return toks


class SequentialLoader:
    """text/data_loader.h, sequential mode, one rank."""

    def __init__(self, patterns, B, T):
        paths = []
        for p in patterns:
            m = sorted(glob.glob(p)) if any(c in p for c in "*?[") else [p]
            if not m:
                raise SystemExit("reference_trainer: no shard matches %s" % p)
            paths += m
        self.shards = [read_shard_tokens(p) for p in paths]
        self.B, self.T = B, T
        S = B * T
        for p, s in zip(paths, self.shards):
            if len(s) < S + 1:
                raise SystemExit("reference_trainer: %s holds %d tokens, fewer than batch*seq+1 = %d" % (p, len(s), S + 1))
        self.reset()

    def reset(self):
        self.shard, self.window, self.epoch = 0, 0, 0

    def state(self):
        return {"shard": self.shard, "window": self.window, "epoch": self.epoch}

    def load_state(self, st):
        self.shard, self.window, self.epoch = st["shard"], st["window"], st["epoch"]

    def next(self):
        B, T, S = self.B, self.T, self.B * self.T
        sh = self.shards[self.shard]
        base = self.window * S
        buf = torch.from_numpy(np.asarray(sh[base:base + S + 1], dtype=np.int64))
        x, y = buf[:-1].reshape(B, T), buf[1:].reshape(B, T)
        self.window += 1
        if self.window * S + S + 1 > len(sh):
            self.window = 0
            self.shard += 1
            if self.shard == len(self.shards):
                self.shard, self.epoch = 0, self.epoch + 1
        return x, y


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--init", required=True, help="initial weights (safetensors, canonical names)")
    p.add_argument("--data", required=True, nargs="+")
    p.add_argument("--val-data", nargs="+", default=[])
    p.add_argument("--out", required=True, help="directory for metrics.jsonl and the checkpoint")
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--steps", type=int, required=True, help="schedule length")
    p.add_argument("--stop-after", type=int, default=0, help="stop after this step (the schedule still spans --steps)")
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--schedule", choices=["cosine", "wsd", "constant"], default="cosine")
    p.add_argument("--min-lr-frac", type=float, default=0.1)
    p.add_argument("--decay-frac", type=float, default=0.2)
    p.add_argument("--wd", type=float, default=0.0)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--momentum", type=float, default=0.95)
    p.add_argument("--muon-scale", choices=["rms", "shape"], default="rms")
    p.add_argument("--ns-mode", choices=["fp32", "bf16"], default="bf16")
    p.add_argument("--amp", choices=["bf16", "none"], default="bf16")
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--ckpt-every", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from --out/reference_checkpoint.pt")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--round-params", choices=["none", "bf16"], default="none",
                   help="bf16: the forward reads every parameter rounded to bf16 (the C++ bf16 model's policy), "
                        "not only the operands of matrix products as autocast does")
    p.add_argument("--mixer", choices=["batched", "chunked"], default="batched",
                   help="the GLA chunked form: all chunks in batched products (default) or one chunk at a time")
    p.add_argument("--document-separator", type=int, default=None,
                   help="keep documents apart (varlen), each starting at this token (2, </s>), as "
                        "`laplace train` does when asked; default: each row is one document")
    a = p.parse_args(argv)

    dev = torch.device(a.device)
    cfg = ref.load_config(a.config)
    params = ref.read_safetensors(a.init)
    names = [n for n, _ in ref.param_shapes(cfg)]
    missing = [n for n in names if n not in params]
    if missing:
        raise SystemExit("reference_trainer: %s lacks %s" % (a.init, missing[0]))
    model = ref.Laplace(cfg, params).to(dev)
    if a.round_params == "bf16":
        model.round_params = torch.bfloat16
    opt = ref.Optimizer(model, wd=a.wd, max_grad_norm=a.max_grad_norm, momentum=a.momentum,
                        scale_mode=a.muon_scale, ns_mode=a.ns_mode)
    train = SequentialLoader(a.data, a.batch, a.seq)
    val = SequentialLoader(a.val_data, a.batch, a.seq) if a.val_data else None
    os.makedirs(a.out, exist_ok=True)
    ckpt_path = os.path.join(a.out, "reference_checkpoint.pt")
    metrics_path = os.path.join(a.out, "metrics.jsonl")
    step0 = 0
    if a.resume and os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=dev)
        with torch.no_grad():
            for n, prm in model.named():
                prm.copy_(ck["params"][n])
        for n in opt.state:
            for t, s in zip(opt.state[n], ck["opt_state"][n]):
                t.copy_(s)
        opt.t, step0 = ck["opt_t"], ck["step"]
        train.load_state(ck["loader"])
        print("resumed from %s at step %d" % (ckpt_path, step0), flush=True)
    elif os.path.exists(metrics_path):
        os.unlink(metrics_path)

    amp = torch.autocast(device_type=dev.type, dtype=torch.bfloat16) if a.amp == "bf16" else None
    state_dtype = torch.float32 if a.amp == "bf16" else None

    def forward_loss(x, y):
        x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
        if amp is None:
            logits, _ = model(x, mixer=a.mixer, document_separator=a.document_separator)
            return ref.loss_fn(logits, y)
        with amp:
            logits, _ = model(x, mixer=a.mixer, state_dtype=state_dtype, document_separator=a.document_separator)
            return ref.loss_fn(logits.float(), y)

    def save(next_step):
        tmp = "%s.tmp.%d" % (ckpt_path, os.getpid())
        torch.save({"params": {n: t.detach() for n, t in model.named()}, "opt_state": opt.state,
                    "opt_t": opt.t, "step": next_step, "loader": train.state()}, tmp)
        os.replace(tmp, ckpt_path)

    tokens_per_step = a.batch * a.seq * a.grad_accum
    flops_per_token = 6 * (sum(t.numel() for n, t in model.named() if ref.is_body(n)) + cfg.V * cfg.D) + \
        cfg.L * 3 * cfg.H * (cfg.C * (cfg.dk + cfg.dv) + 4 * cfg.dk * cfg.dv)
    t_start = time.time()
    last = min(a.steps, a.stop_after) if a.stop_after > 0 else a.steps
    mf = open(metrics_path, "a")
    for step in range(step0, last):
        t0 = time.time()
        lr = ref.lr_at(step, a.steps, a.lr, a.warmup, a.schedule, a.min_lr_frac, a.decay_frac)
        model.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for _ in range(a.grad_accum):
            x, y = train.next()
            loss = forward_loss(x, y)
            (loss / a.grad_accum).backward()
            loss_sum += float(loss.detach())
        norm, ok = opt.step(lr)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        dt = time.time() - t0
        rec = {"step": step, "loss": loss_sum / a.grad_accum, "lr": lr, "grad_norm": norm,
               "tokens_per_s": tokens_per_step / dt, "flops_per_s": tokens_per_step / dt * flops_per_token,
               "elapsed_s": time.time() - t_start, "skipped": not ok}
        mf.write(json.dumps(rec) + "\n")
        mf.flush()
        if step % a.log_every == 0 or step + 1 == last:
            print("step %5d/%d | loss %.4f | lr %.3e | grad norm %.4f | %.0f tok/s%s" % (
                step + 1, a.steps, rec["loss"], lr, norm, rec["tokens_per_s"], "" if ok else " | SKIPPED"), flush=True)
        if val is not None and a.eval_every > 0 and (step + 1) % a.eval_every == 0:
            val.reset()
            with torch.no_grad():
                vl = sum(float(forward_loss(*val.next())) for _ in range(a.eval_batches)) / a.eval_batches
            mf.write(json.dumps({"step": step, "val_loss": vl}) + "\n")
            mf.flush()
            print("step %5d/%d | val loss %.4f" % (step + 1, a.steps, vl), flush=True)
        if a.ckpt_every > 0 and (step + 1) % a.ckpt_every == 0:
            save(step + 1)
    save(last)
    mf.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
