"""Muon: Newton-Schulz-orthogonalised momentum for hidden matrices, AdamW for the rest
(embeddings, output layer, norms, biases, routers), on every layout. docs/optimizers.md.

- ``newton_schulz.py``  the orthogonalisation and the update scale (pure tensor math)
- ``exchange.py``       owner-computes: which rank orthogonalises each matrix, and the
                        all-to-alls that bring it the pieces and send them back
- ``zero_one.py``       ZeRO-1: each data-parallel rank owns whole parameters (Megatron's
                        layer-wise distributed optimizer), one all-gather after the update
- ``ownership.py``      the rule of who owns which parameter (torch-free: the planner's too)
- ``qk_clip.py``        QK-clip (MuonClip): heads whose logits passed a threshold scaled back
                        after the step (``train.muon_qk_clip``; a hook on ``Muon.after_step``)
- ``optimizer.py``      the optimizer (``Muon``), its parameter split and ``build_muon``
"""
