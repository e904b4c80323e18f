"""What the plot scripts share: reading JSON-lines files with errors that name the line, checking
the figure's file type, loading matplotlib headless, and saving — every failure an InputError
that the script prints as one line (never a traceback)."""
import json
import math
import os


class InputError(Exception):
    pass


def check_out(path):
    """The figure's path must end in .png or .svg."""
    if os.path.splitext(path)[1].lower() not in (".png", ".svg"):
        raise InputError(f"--out must end in .png or .svg, got '{path}'")


def read_json_lines(path):
    """[(where, record)] of a JSON-lines file, blank lines skipped; every record is a JSON object."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise InputError(f"cannot read {path}: {reason}") from None
    out = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{i}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(rec, dict):
            raise InputError(f"{where}: not a JSON object")
        out.append((where, rec))
    return out


def is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def require_numbers(rec, keys, where):
    for k in keys:
        if not is_number(rec.get(k)):
            raise InputError(f"{where}: \"{k}\" is missing or not a number")


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display needed)."""
    try:
        import matplotlib
    except ImportError:
        raise InputError("matplotlib is not installed (Debian: apt-get install python3-matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, plt, path):
    try:
        fig.savefig(path)
    except OSError as e:
        raise InputError(f"cannot write {path}: {e.strerror or e}") from None
    finally:
        plt.close(fig)
