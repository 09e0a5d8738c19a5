"""A bigram model: the next character's logits from the current one's embedding."""

from torch import nn


class Bigram(nn.Module):
    def __init__(self, vocab_size, dim=16):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, dim)
        self.out = nn.Linear(dim, vocab_size)

    def forward(self, x):
        return self.out(self.emb(x))
