"""Small torch models for the torch adapter's tests: a pre-norm transformer block and a tiny
language model built from ``torch.nn.RMSNorm`` (``rmsnorm_hip.torch.replace_rmsnorm`` swaps them
for ours), data with something to learn, and a training loop.  No test functions here."""
import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))`` (causal attention)."""

    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.attn_norm = nn.RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)
        self.mlp_norm = nn.RMSNorm(d)
        self.up = nn.Linear(d, 4 * d, bias=False)
        self.down = nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, self.heads, d // self.heads).permute(
            2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.mlp_norm(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab=256, d=128, heads=4, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm = nn.RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def markov_batches(steps, batch, seq, vocab, device, seed=0):
    """Token sequences from a fixed random sparse Markov chain (each token has 4 likely
    successors): a model can learn it, so the loss falls well below ln(vocab)."""
    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(vocab, (vocab, 4), generator=g)
    out = []
    for _ in range(steps):
        tokens = torch.empty(batch, seq + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(vocab, (batch,), generator=g)
        for t in range(seq):
            pick = torch.randint(4, (batch,), generator=g)
            tokens[:, t + 1] = successors[tokens[:, t], pick]
        out.append(tokens.to(device))
    return out


def train(model, batches, lr=2e-3):
    """AdamW steps over ``batches``; the float32 cross-entropy loss of each step."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for tokens in batches:
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                               tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses
