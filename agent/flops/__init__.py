"""The FLOP model: FLOPs per step (user value, analytic formula or FlopCounterMode), the analytic
architectures, the per-op formulas, and the `mfuwatch flops` command."""
