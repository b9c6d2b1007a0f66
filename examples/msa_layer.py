"""A GQA attention layer with MSA, trained with the proxy KL (runs on CPU in a few seconds).

python examples/msa_layer.py
"""

import torch
import torch.nn as nn

import flash_msa


class MSAAttention(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, n_proxy_heads, proxy_dim, top_k, block_size=128):
        super().__init__()
        self.h, self.hkv, self.hp, self.d = n_heads, n_kv_heads, n_proxy_heads, dim // n_heads
        self.top_k, self.block_size = top_k, block_size
        self.wq = nn.Linear(dim, n_heads * self.d, bias=False)
        self.wkv = nn.Linear(dim, 2 * n_kv_heads * self.d, bias=False)
        self.wo = nn.Linear(n_heads * self.d, dim, bias=False)
        # the proxy (index) attention: Hp query heads and one shared key head (Hpk = 1)
        self.wq_proxy = nn.Linear(dim, n_proxy_heads * proxy_dim, bias=False)
        self.wk_proxy = nn.Linear(dim, proxy_dim, bias=False)
        self.proxy_dim = proxy_dim

    def forward(self, x):  # x: (B, S, dim)
        B, S, _ = x.shape
        q = self.wq(x).view(B, S, self.h, self.d)
        k, v = self.wkv(x).view(B, S, 2, self.hkv, self.d).unbind(2)
        # As in the MSA paper, the proxy reads a detached input: the KL trains the proxy only,
        # and never pushes the backbone towards what is easy to index.
        xd = x.detach()
        q_proxy = self.wq_proxy(xd).view(B, S, self.hp, self.proxy_dim)
        k_proxy = self.wk_proxy(xd).view(B, S, 1, self.proxy_dim)
        out, kl = flash_msa.msa_attention(
            q_proxy, k_proxy, q, k, v, self.top_k, block_size=self.block_size
        )
        return self.wo(out.reshape(B, S, -1)), kl


def main():
    torch.manual_seed(0)
    layer = MSAAttention(
        dim=256, n_heads=8, n_kv_heads=2, n_proxy_heads=2, proxy_dim=32, top_k=2, block_size=64
    )
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    x = torch.randn(2, 384, 256)
    kl_weight = 1.0
    for step in range(3):
        y, kl = layer(x)
        loss = y.pow(2).mean() + kl_weight * kl  # the KL joins the loss with a weight
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step}: loss {loss.item():.4f}  kl {kl.item():.4f}")


if __name__ == "__main__":
    main()
