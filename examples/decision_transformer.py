"""A Decision-Transformer-style model: Chen et al. 2021, "Decision Transformer: Reinforcement Learning via
Sequence Modeling".

Offline RL as sequence modeling: a trajectory is the token stream ``R_1, s_1, a_1, R_2, s_2, a_2, ...``
(``R_t`` the return-to-go, the reward still to collect from step ``t``), embedded per modality plus a
learned timestep embedding, and a causal :class:`qkv.nn.TransformerDecoder` predicts ``a_t`` from the
token of ``s_t``. At test time one asks for a high return and the model acts to collect it.

Environment (a contextual bandit unrolled for ``T`` steps): each step shows a random state ``s`` in
``0..S-1``; action ``a`` earns reward 1 when ``a == s % A``. The offline data come from epsilon-greedy
behaviour policies with epsilon uniform in [0, 1], so returns range from 0 to ``T`` and the return-to-go
tells the model how well the rest of the trajectory is played.

Run: ``python examples/decision_transformer.py`` (a few seconds on a CPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qkv.nn import TransformerConfig, TransformerDecoder

__all__ = ["DecisionTransformer", "collect", "rollout", "main"]

T, S, A = 6, 8, 4  # steps per episode, states, actions


def _reward(states: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    return (actions == states % A).float()


def collect(n: int, *, generator: torch.Generator | None = None):
    """``n`` behaviour trajectories: returns-to-go (n, T) float, states (n, T) and actions (n, T) int64."""
    states = torch.randint(0, S, (n, T), generator=generator)
    epsilon = torch.rand(n, 1, generator=generator)
    explore = torch.rand(n, T, generator=generator) < epsilon
    actions = torch.where(explore, torch.randint(0, A, (n, T), generator=generator), states % A)
    rewards = _reward(states, actions)
    returns_to_go = rewards.flip(1).cumsum(1).flip(1)
    return returns_to_go, states, actions


class DecisionTransformer(nn.Module):
    """Embeds (return-to-go, state, action) triples and runs a causal decoder over the 3T tokens.

    ``forward(returns_to_go (B, T), states (B, T), actions (B, T)) -> (B, T, A)`` action logits read at each
    state token (so ``a_t`` is predicted from ``R_1..R_t, s_1..s_t, a_1..a_{t-1}``).
    """

    def __init__(self, *, d_model: int = 64, n_heads: int = 4, n_layers: int = 2) -> None:
        super().__init__()
        cfg = TransformerConfig(d_model=d_model, n_heads=n_heads, n_layers=n_layers, d_ff=2 * d_model,
                                activation="gelu", norm="layer", position="none")  # time comes from embed_time
        self.embed_return = nn.Linear(1, d_model)
        self.embed_state = nn.Embedding(S, d_model)
        self.embed_action = nn.Embedding(A, d_model)
        self.embed_time = nn.Embedding(T, d_model)
        self.decoder = TransformerDecoder(cfg)  # causal self attention over the interleaved tokens
        self.predict_action = nn.Linear(d_model, A)

    def forward(self, returns_to_go: torch.Tensor, states: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        B = states.shape[0]
        time = self.embed_time(torch.arange(T, device=states.device))  # (T, d)
        r = self.embed_return(returns_to_go.unsqueeze(-1) / T) + time  # (B, T, d)
        s = self.embed_state(states) + time
        a = self.embed_action(actions) + time
        tokens = torch.stack((r, s, a), dim=2).reshape(B, 3 * T, -1)  # R_1, s_1, a_1, R_2, ...
        h = self.decoder(tokens).view(B, T, 3, -1)
        return self.predict_action(h[:, :, 1])  # read at the state tokens


@torch.no_grad()
def rollout(model: DecisionTransformer, target_return: float, n: int, *, generator=None) -> float:
    """Play ``n`` episodes asking for ``target_return``; the mean return collected, divided by ``T``."""
    states = torch.randint(0, S, (n, T), generator=generator)  # the environment's draws, revealed step by step
    actions = torch.zeros(n, T, dtype=torch.long)
    rtg = torch.zeros(n, T)
    rtg[:, 0] = target_return
    total = torch.zeros(n)
    for t in range(T):
        # Tokens after s_t are placeholders; the causal mask keeps them from influencing step t.
        actions[:, t] = model(rtg, states, actions)[:, t].argmax(-1)
        reward = _reward(states[:, t], actions[:, t])
        total += reward
        if t + 1 < T:
            rtg[:, t + 1] = rtg[:, t] - reward
    return float(total.mean()) / T


def main(steps: int = 200, seed: int = 0, *, batch: int = 64, verbose: bool = False) -> dict[str, float]:
    """Train on behaviour data; return first/last loss and normalized returns when asking for T and for 0."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    model = DecisionTransformer()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    losses = []
    for step in range(steps):
        rtg, states, actions = collect(batch, generator=g)
        logits = model(rtg, states, actions)
        loss = F.cross_entropy(logits.reshape(-1, A), actions.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if verbose and step % 50 == 0:
            print(f"step {step:4d}  loss {loss.item():.3f}")
    model.eval()
    return {"loss_first": losses[0], "loss_last": sum(losses[-10:]) / len(losses[-10:]),
            "return_high": rollout(model, float(T), 512, generator=g),
            "return_low": rollout(model, 0.0, 512, generator=g), "return_random": 1 / A}


if __name__ == "__main__":
    print(main(verbose=True))
