"""``CheckpointText``: the user's own checkpoint for ``qkv attention --model DIR`` and ``qkv explore --model DIR``.

Any checkpoint directory :func:`qkv.models.from_hf` loads (an encoder such as BERT, a decoder such as Llama or
Qwen3, a hybrid whose attention layers are captured), with the tokenizer saved beside it
(``transformers.AutoTokenizer``, read from the directory only). Its attention on a text comes from
:func:`qkv.interpret.capture` like the bundled model's: one (H, N, N) map per attention layer and the rollout.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["CheckpointText"]

#: Files one of which a saved tokenizer writes (a fast tokenizer's JSON, a SentencePiece model, a WordPiece or BPE
#: vocabulary); without any, AutoTokenizer would build an empty one that maps every word to [UNK].
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.txt", "vocab.json")


class CheckpointText:
    """A checkpoint's model and tokenizer.

    Args:
        path: a directory with ``config.json``, the weights (``*.safetensors``) and the tokenizer's files.

    Raises ``ValueError`` naming the directory and the fix when it is missing, holds no model ``from_hf`` builds,
    or holds no tokenizer.

    Attributes: ``name`` (the directory's name), ``model``, ``tokenizer``, ``max_seq_length`` (the longest text in
    tokens: the config's ``max_position_embeddings``, else 512).
    """

    def __init__(self, path) -> None:
        path = Path(path)
        if not (path / "config.json").is_file():
            raise ValueError(f"--model {path}: no config.json there; give a checkpoint directory (e.g. one written by "
                             f"transformers' save_pretrained)")
        from qkv.models import from_hf
        from qkv.models.loading import CheckpointError

        try:
            self.model = from_hf(path).eval()
        except (CheckpointError, KeyError, ValueError, TypeError, OSError) as e:
            raise ValueError(f"--model {path}: qkv cannot build this checkpoint ({e})") from None
        if not any((path / f).is_file() for f in _TOKENIZER_FILES):
            raise ValueError(f"--model {path}: no tokenizer there (none of {', '.join(_TOKENIZER_FILES)}); save it "
                             f"beside the weights with tokenizer.save_pretrained(DIR)")
        try:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except ImportError:
            raise ValueError("--model needs HF transformers for the checkpoint's tokenizer: pip install "
                             "transformers") from None
        except (OSError, ValueError) as e:
            raise ValueError(f"--model {path}: no tokenizer could be read there ({type(e).__name__}); save it beside "
                             f"the weights with tokenizer.save_pretrained(DIR)") from None
        self.name = path.name or str(path)
        limit = getattr(getattr(self.model, "config", None), "max_position_embeddings", None)
        self.max_seq_length = limit if isinstance(limit, int) and limit > 1 else 512

    def attention(self, text: str, *, max_tokens: int | None = None):
        """The :class:`qkv.cli.attention.TextAttention` of ``text`` (the tokenizer's special tokens included);
        ``ValueError`` when it is empty or longer than ``max_tokens`` (default ``max_seq_length``)."""
        import torch

        from qkv.interpret import attention_rollout, capture

        from .attention import TextAttention

        if not isinstance(text, str) or not text.strip():
            raise ValueError("the text is empty; give a sentence, e.g. qkv attention \"The cat sat.\" --model DIR")
        ids = list(self.tokenizer(text)["input_ids"])
        limit = min(max_tokens or self.max_seq_length, self.max_seq_length)
        if len(ids) > limit:
            raise ValueError(f"the text has {len(ids)} tokens; the limit is {limit} tokens: shorten it")
        with torch.no_grad():
            maps = capture(self.model, torch.tensor([ids]))
        if not maps:
            raise ValueError(f"{self.name} has no attention layer that qkv.interpret.capture can record")
        maps = [m.float() for m in maps]
        tokens = [str(t) for t in self.tokenizer.convert_ids_to_tokens(ids)]
        return TextAttention(tokens, [m[0] for m in maps], attention_rollout(maps)[0])
