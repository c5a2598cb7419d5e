"""The worker side of an offload tier: KV tensors, their layouts, and the transfer engine."""
