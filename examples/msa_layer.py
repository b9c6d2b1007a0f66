"""A GQA attention layer with MSA (flash_msa.nn.MSAttention), trained with the proxy KL.

Runs on CPU in a few seconds: python examples/msa_layer.py
"""

import torch

from flash_msa.nn import MSAIndexer, MSAttention


def main():
    torch.manual_seed(0)
    hidden = 256
    layer = MSAttention(
        hidden,
        num_heads=8,
        num_key_value_heads=2,
        top_k=2,
        block_size=64,
        # the proxy: 2 query heads (one per KV group, as in the MSA paper), one key head, Dp = 32
        indexer=MSAIndexer(hidden, num_proxy_heads=2, proxy_head_dim=32),
        kl_coeff=1.0,  # the KL's gradient rides on the output's backward (docs/nn.md)
    )
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    x = torch.randn(2, 384, hidden)
    for step in range(3):
        y, kl = layer(x)  # y: (2, 384, 256); kl: detached, for logging
        loss = y.pow(2).mean()  # no KL term needed: loss.backward() also trains the proxy
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step}: loss {loss.item():.4f}  kl {kl.item():.4f}")


if __name__ == "__main__":
    main()
