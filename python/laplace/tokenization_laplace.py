"""LaplaceTokenizer: the SentencePiece tokenizer of a Laplace model directory (tokenizer.model).

The same ids as the C++ tokenizer (text/tokenizer.h): <unk> 0, <s> (bos) 1, </s> (eos) 2, <pad> 3 for models
trained by `laplace tokenizer train` (the model file's own ids are used), no bos/eos added unless asked, byte
pieces for what SentencePiece cannot take (a literal U+2581, and bytes given as surrogate escapes), decode of
byte pieces back to text. Needs the `sentencepiece` package (Debian: python3-sentencepiece), imported when a
tokenizer is created.

Call it like a transformers tokenizer for generate():
    tok = LaplaceTokenizer.from_pretrained("runs/tiny")
    batch = tok(["Once upon a time", "Hi"], return_tensors="pt", padding=True)   # left padding, attention_mask
    out = model.generate(**batch, max_new_tokens=20); print(tok.batch_decode(out))
"""
import os
import shutil

VOCAB_FILE = "tokenizer.model"
_SPACE_MARKER = "\u2581"


class LaplaceTokenizer(object):
    vocab_files_names = {"vocab_file": VOCAB_FILE}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file, padding_side="left", add_bos_token=False, add_eos_token=False):
        try:
            import sentencepiece as spm
        except ImportError as e:
            raise ImportError("LaplaceTokenizer needs the sentencepiece package (Debian: apt-get install "
                              "python3-sentencepiece; pip: pip install sentencepiece)") from e
        if not os.path.isfile(vocab_file):
            raise OSError("no tokenizer model at %s" % vocab_file)
        self.vocab_file = vocab_file
        self.sp = spm.SentencePieceProcessor()
        if not self.sp.Load(vocab_file):
            raise ValueError("%s is not a SentencePiece model" % vocab_file)
        self.padding_side = padding_side
        self.add_bos_token, self.add_eos_token = add_bos_token, add_eos_token
        self._byte_ids = {}
        for b in range(256):
            i = self.sp.PieceToId("<0x%02X>" % b)
            if i != self.sp.unk_id() and self.sp.IsByte(i):
                self._byte_ids[b] = i

    # ---- loading and saving ----
    @classmethod
    def from_pretrained(cls, path, **kwargs):
        """A model directory (its tokenizer.model) or a .model file."""
        f = os.path.join(path, VOCAB_FILE) if os.path.isdir(path) else path
        return cls(f, **kwargs)

    def save_pretrained(self, save_directory, **kwargs):
        os.makedirs(save_directory, exist_ok=True)
        dst = os.path.join(save_directory, VOCAB_FILE)
        if os.path.abspath(dst) != os.path.abspath(self.vocab_file):
            shutil.copyfile(self.vocab_file, dst)
        return (dst,)

    # ---- special tokens (the model file's ids; -1 from SentencePiece -> None) ----
    @staticmethod
    def _id(i):
        return None if i < 0 else int(i)

    @property
    def unk_token_id(self):
        return self._id(self.sp.unk_id())

    @property
    def bos_token_id(self):
        return self._id(self.sp.bos_id())

    @property
    def eos_token_id(self):
        return self._id(self.sp.eos_id())

    @property
    def pad_token_id(self):
        return self._id(self.sp.pad_id())

    def _piece_or_none(self, i):
        return None if i is None else self.sp.IdToPiece(i)

    @property
    def unk_token(self):
        return self._piece_or_none(self.unk_token_id)

    @property
    def bos_token(self):
        return self._piece_or_none(self.bos_token_id)

    @property
    def eos_token(self):
        return self._piece_or_none(self.eos_token_id)

    @property
    def pad_token(self):
        return self._piece_or_none(self.pad_token_id)

    @property
    def all_special_ids(self):
        return [i for i in range(self.vocab_size) if self.sp.IsControl(i) or self.sp.IsUnknown(i)]

    @property
    def vocab_size(self):
        return self.sp.GetPieceSize()

    def __len__(self):
        return self.vocab_size

    def get_vocab(self):
        return {self.sp.IdToPiece(i): i for i in range(self.vocab_size)}

    def convert_ids_to_tokens(self, ids):
        if isinstance(ids, int):
            return self.sp.IdToPiece(ids)
        return [self.sp.IdToPiece(int(i)) for i in ids]

    def convert_tokens_to_ids(self, tokens):
        if isinstance(tokens, str):
            return self.sp.PieceToId(tokens)
        return [self.sp.PieceToId(t) for t in tokens]

    # ---- text <-> ids ----
    def _byte_piece(self, b):
        if b not in self._byte_ids:
            raise ValueError("tokenizer %s has no byte piece for 0x%02X (train it with byte fallback)"
                             % (self.vocab_file, b))
        return self._byte_ids[b]

    def encode(self, text, add_bos=None, add_eos=None):
        """str (or bytes) -> ids, as the C++ Tokenizer::encode: SentencePiece on the text, byte pieces for a literal
        U+2581 and for bytes that are not UTF-8 (bytes input, or str with surrogate escapes)."""
        if isinstance(text, (bytes, bytearray)):
            text = bytes(text).decode("utf-8", errors="surrogateescape")
        ids, run = [], []

        def flush():
            if run:
                ids.extend(self.sp.EncodeAsIds("".join(run)))
                del run[:]

        for ch in text:
            o = ord(ch)
            if ch == _SPACE_MARKER:
                flush()
                ids.extend(self._byte_piece(b) for b in ch.encode("utf-8"))
            elif 0xDC80 <= o <= 0xDCFF:  # a surrogate-escaped byte
                flush()
                ids.append(self._byte_piece(o - 0xDC00))
            elif 0xD800 <= o <= 0xDFFF:
                raise ValueError("cannot encode the lone surrogate U+%04X" % o)
            else:
                run.append(ch)
        flush()
        if add_bos if add_bos is not None else self.add_bos_token:
            ids.insert(0, self.bos_token_id)
        if add_eos if add_eos is not None else self.add_eos_token:
            ids.append(self.eos_token_id)
        return ids

    def _check_ids(self, ids):
        ids = [int(i) for i in (ids.tolist() if hasattr(ids, "tolist") else ids)]
        for pos, i in enumerate(ids):
            if not 0 <= i < self.vocab_size:
                raise ValueError("cannot decode token id %d at position %d: out of range [0, %d)"
                                 % (i, pos, self.vocab_size))
        return ids

    def decode(self, ids, skip_special_tokens=True, **kwargs):
        """ids -> text. Control tokens (bos/eos/pad) decode to nothing; byte pieces become their bytes, and byte
        runs that are not UTF-8 become U+FFFD (as the C++ decode)."""
        ids = self._check_ids(ids)
        if not skip_special_tokens:
            out, run = [], []
            for i in ids:
                if self.sp.IsControl(i):
                    if run:
                        out.append(self.sp.DecodeIds(run))
                        run = []
                    out.append(self.sp.IdToPiece(i))
                else:
                    run.append(i)
            if run:
                out.append(self.sp.DecodeIds(run))
            return "".join(out)
        return self.sp.DecodeIds(ids)

    def decode_bytes(self, ids):
        """ids -> the exact bytes encode() read (byte pieces as raw bytes, U+2581 in pieces as spaces)."""
        out = bytearray()
        for i in self._check_ids(ids):
            if self.sp.IsControl(i):
                continue
            if self.sp.IsByte(i):
                out.append(int(self.sp.IdToPiece(i)[3:5], 16))
            else:
                out += self.sp.IdToPiece(i).replace(_SPACE_MARKER, " ").encode("utf-8")
        return bytes(out)

    def batch_decode(self, sequences, skip_special_tokens=True, **kwargs):
        return [self.decode(s, skip_special_tokens=skip_special_tokens) for s in sequences]

    def tokenize(self, text):
        return self.convert_ids_to_tokens(self.encode(text))

    def __call__(self, text, return_tensors=None, padding=False, add_bos=None, add_eos=None, padding_side=None,
                 **kwargs):
        """str or list of str -> {"input_ids", "attention_mask"} (lists, or tensors with return_tensors="pt").
        padding=True / "longest" pads to the longest row with pad_token_id, on padding_side (default "left",
        what generate() needs; the model treats left padding exactly)."""
        single = isinstance(text, str)
        rows = [self.encode(t, add_bos, add_eos) for t in ([text] if single else text)]
        masks = [[1] * len(r) for r in rows]
        side = padding_side or self.padding_side
        if not padding and return_tensors and len({len(r) for r in rows}) > 1:
            raise ValueError("rows of different lengths need padding=True for return_tensors")
        if padding:
            n = max(len(r) for r in rows)
            pad = self.pad_token_id if self.pad_token_id is not None else 0
            for r, m in zip(rows, masks):
                fill = n - len(r)
                if side == "left":
                    r[:0], m[:0] = [pad] * fill, [0] * fill
                else:
                    r.extend([pad] * fill)
                    m.extend([0] * fill)
        if return_tensors == "pt":
            import torch
            return {"input_ids": torch.tensor(rows, dtype=torch.long),
                    "attention_mask": torch.tensor(masks, dtype=torch.long)}
        if return_tensors is not None:
            raise ValueError("return_tensors must be None or 'pt'")
        if single:
            return {"input_ids": rows[0], "attention_mask": masks[0]}
        return {"input_ids": rows, "attention_mask": masks}
