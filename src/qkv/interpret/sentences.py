"""A real measure for head importance and pruning of sentence encoders (the bundled all-MiniLM-L6-v2).

Michel et al. 2019 score heads by the gradient of a task loss with respect to head gates. The pruning
measure here is embedding agreement: the mean cosine similarity between the pruned model's embeddings and
the unpruned ones on real sentences. The agreement itself has zero gradient at the unpruned model (it is
maximal there), so importance comes from a ranking loss with a gradient (cross-entropy of scaled cosine
similarities, the "MultipleNegativesRankingLoss" sentence-transformers trains with):

- ``"agreement"`` (default): each sentence's gated embedding should pick its own unpruned embedding out of
  the batch's; the importance that predicts the agreement measure best (heads ranked least important by
  it cost the least agreement when removed).
- ``"paraphrase"``: each sentence's embedding should pick its paraphrase out of the batch, the model's
  training task, on ``PARAPHRASES``.

``PARAPHRASES`` holds (sentence, paraphrase) pairs written for this purpose, so nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["PARAPHRASES", "batch_inputs", "embed", "contrastive_loss", "agreement_loss", "embedding_agreement",
           "encoder_head_importance"]

#: (sentence, paraphrase) pairs.
PARAPHRASES: tuple[tuple[str, str], ...] = (
    ("A man is playing a guitar on stage.", "On stage, a man plays the guitar."),
    ("The cat is sleeping on the warm windowsill.", "A cat naps on a sunny window ledge."),
    ("Heavy rain flooded the streets of the city.", "The city's roads were flooded after a downpour."),
    ("She bought fresh bread at the bakery this morning.", "This morning she picked up a fresh loaf from the bakery."),
    ("The train to Berlin was delayed by two hours.", "The Berlin train arrived two hours late."),
    ("Children are building a sandcastle on the beach.", "Kids build a castle out of sand at the seaside."),
    ("The stock market fell sharply on Monday.", "Share prices dropped steeply at the start of the week."),
    ("He forgot his umbrella at the restaurant.", "He left his umbrella behind at the restaurant."),
    ("The doctor advised her to get more sleep.", "Her physician told her she should rest more."),
    ("A dog is chasing a ball across the park.", "In the park, a dog runs after a ball."),
    ("The new phone has a much better camera.", "The camera on the latest phone is far superior."),
    ("They planted tomatoes in the backyard garden.", "Tomatoes were planted in their back garden."),
    ("The museum is closed for renovations until May.", "Renovation work keeps the museum shut until May."),
    ("The chef is chopping onions in the kitchen.", "In the kitchen, the cook slices onions."),
    ("Our flight was cancelled because of the storm.", "The storm forced the airline to cancel our flight."),
    ("The students are studying for their final exams.", "Pupils are preparing for end-of-year tests."),
    ("A woman is riding a bicycle along the river.", "Along the riverbank, a woman cycles."),
    ("The company hired twenty new engineers last year.", "Last year the firm took on twenty more engineers."),
    ("The baby laughed when the puppy licked her face.", "The infant giggled as the puppy licked her."),
    ("The old bridge was replaced with a modern one.", "A modern bridge now stands where the old one was."),
    ("He is reading a novel by the fireplace.", "By the fire, he reads a book."),
    ("The orchestra performed Beethoven's ninth symphony.", "Beethoven's Ninth was played by the orchestra."),
    ("Prices for fruit and vegetables went up again.", "Fruit and vegetable prices rose once more."),
    ("The hikers reached the summit before noon.", "Before midday the climbers got to the top of the mountain."),
)


def batch_inputs(encoder, texts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (B, N) right-padded with 0 and the HF attention mask (B, N) for a :class:`SentenceEncoder`."""
    ids = encoder.tokenize(list(texts))
    n = max(len(t) for t in ids)
    out = torch.zeros(len(ids), n, dtype=torch.int64)
    mask = torch.zeros(len(ids), n, dtype=torch.int64)
    for i, t in enumerate(ids):
        out[i, :len(t)] = torch.tensor(t)
        mask[i, :len(t)] = 1
    return out, mask


def embed(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Differentiable mean-pooled, L2-normalized embeddings (B, d) of a qkv BERT model."""
    h = model(ids, attention_mask=mask).last_hidden_state  # (B, N, d)
    w = mask.to(h.dtype).unsqueeze(-1)
    return nn.functional.normalize((h * w).sum(1) / w.sum(1), dim=-1)


def contrastive_loss(model: nn.Module, batch, *, scale: float = 20.0) -> torch.Tensor:
    """In-batch ranking loss of ``batch = ((ids_a, mask_a), (ids_b, mask_b))``: row ``i`` of ``a`` should be
    most similar to row ``i`` of ``b``."""
    (ia, ma), (ib, mb) = batch
    a, b = embed(model, ia, ma), embed(model, ib, mb)
    logits = scale * a @ b.T
    return nn.functional.cross_entropy(logits, torch.arange(a.shape[0]))


def embedding_agreement(model: nn.Module, batch, reference: torch.Tensor) -> float:
    """Mean cosine similarity of the model's embeddings of ``batch = (ids, mask)`` with ``reference``."""
    with torch.no_grad():
        e = embed(model, *batch)
    return float((e * reference).sum(-1).mean())


def agreement_loss(model: nn.Module, batch, *, scale: float = 20.0) -> torch.Tensor:
    """Ranking loss of ``batch = (ids, mask, reference)``: row ``i`` of the model's embeddings should be most
    similar to ``reference[i]`` (the unpruned model's embedding of the same sentence)."""
    ids, mask, reference = batch
    e = embed(model, ids, mask)
    return nn.functional.cross_entropy(scale * e @ reference.T, torch.arange(e.shape[0]))


def encoder_head_importance(encoder, texts: Sequence[str] | None = None, *, loss: str = "agreement",
                            batch_size: int = 16) -> torch.Tensor:
    """Michel et al. head importance (L, H) of a :class:`qkv.models.embed.SentenceEncoder`'s model.

    Args:
        encoder: the sentence encoder (build it with ``gemm="blas"``: importance needs gradients).
        texts: sentences for ``loss="agreement"`` (default: every sentence of ``PARAPHRASES``); for
            ``"paraphrase"``, the (sentence, paraphrase) pairs (default ``PARAPHRASES``).
        loss: ``"agreement"`` or ``"paraphrase"`` (see the module docstring).
        batch_size: sentences (or pairs) per batch; the other rows of a batch are the ranking's negatives.
    """
    from .gates import model_head_importance

    if loss not in ("agreement", "paraphrase"):
        raise ValueError(f"encoder_head_importance: loss must be 'agreement' or 'paraphrase', got {loss!r}")
    if not isinstance(batch_size, int) or batch_size < 2:
        raise ValueError(f"encoder_head_importance: batch_size must be an int >= 2, got {batch_size!r}")
    if loss == "paraphrase":
        pairs = list(PARAPHRASES if texts is None else texts)
        if not all(isinstance(p, (tuple, list)) and len(p) == 2 for p in pairs):
            raise ValueError("encoder_head_importance: loss='paraphrase' takes (sentence, paraphrase) pairs")
        chunks = [pairs[s:s + batch_size] for s in range(0, len(pairs), batch_size)]
        batches = [(batch_inputs(encoder, [a for a, _ in c]), batch_inputs(encoder, [b for _, b in c]))
                   for c in chunks if len(c) >= 2]
        fn = contrastive_loss
    else:
        sents = [s for p in PARAPHRASES for s in p] if texts is None else list(texts)
        if not all(isinstance(t, str) for t in sents):
            raise ValueError("encoder_head_importance: loss='agreement' takes a list of sentences")
        batches = []
        for s in range(0, len(sents), batch_size):
            chunk = sents[s:s + batch_size]
            if len(chunk) >= 2:
                ids, mask = batch_inputs(encoder, chunk)
                with torch.no_grad():
                    batches.append((ids, mask, embed(encoder.model, ids, mask)))
        fn = agreement_loss
    if not batches:
        raise ValueError("encoder_head_importance: need at least 2 sentences (or pairs)")
    return model_head_importance(encoder.model, batches, fn)
