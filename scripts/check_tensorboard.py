#!/usr/bin/env python3
"""Loads `laplace train --tensorboard DIR` event files with TensorBoard's own reader.

  scripts/check_tensorboard.py DIR [--require TAG ...]

Prints, for every event file in DIR, how many events TensorBoard's file loader reads from
it, then, from an EventAccumulator over DIR (what TensorBoard's scalar dashboard shows), each
scalar tag with its point count, step range and last value. Exit status: 0 when every
required tag (default: loss) is there, 1 when one is missing or DIR holds no event file,
2 when tensorboard is not installed. Needs the tensorboard Python package (not a Debian
package: run it where TensorBoard is installed, e.g. the GPU machine); not part of CI.
"""
import argparse
import glob
import os
import sys


def main(argv=None):
    p = argparse.ArgumentParser(description="Load TensorBoard event files with TensorBoard's reader.")
    p.add_argument("dir", help="the --tensorboard directory")
    p.add_argument("--require", action="append", default=None, metavar="TAG",
                   help="a scalar tag that must be present (repeatable; default: loss)")
    args = p.parse_args(argv)
    required = args.require or ["loss"]
    try:
        from tensorboard.backend.event_processing import event_accumulator
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    except ImportError as e:
        print(f"check_tensorboard: error: tensorboard is not installed ({e})", file=sys.stderr)
        return 2
    if not os.path.isdir(args.dir):
        print(f"check_tensorboard: error: {args.dir} is not a directory", file=sys.stderr)
        return 1
    files = sorted(glob.glob(os.path.join(args.dir, "*tfevents*")))
    if not files:
        print(f"check_tensorboard: error: no event files (*tfevents*) in {args.dir}", file=sys.stderr)
        return 1
    for f in files:
        events = list(EventFileLoader(f).Load())
        version = events[0].file_version if events else ""
        print(f"{os.path.basename(f)}: {len(events)} events, file_version {version or '(none)'}")

    acc = EventAccumulator(args.dir, size_guidance={event_accumulator.SCALARS: 0})  # 0: keep every point
    acc.Reload()
    tags = sorted(acc.Tags().get(event_accumulator.SCALARS, []))
    for tag in tags:
        points = acc.Scalars(tag)
        print(f"{tag}: {len(points)} points, steps {points[0].step}..{points[-1].step}, last {points[-1].value:.6g}")
    missing = [t for t in required if t not in tags]
    if missing:
        print(f"check_tensorboard: error: no scalar {', '.join(missing)} in {args.dir} (tags: {', '.join(tags) or 'none'})",
              file=sys.stderr)
        return 1
    print(f"check_tensorboard: ok: {len(files)} file(s), {len(tags)} scalar tags")
    return 0


if __name__ == "__main__":
    sys.exit(main())
