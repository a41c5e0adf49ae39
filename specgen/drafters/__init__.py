"""The learned drafters' checkpoints, one module each: their weights (typed), reading them in the layouts
their projects publish, writing them, the ones shipped for the default model, and their reference pass where
one runs outside the proposer (Paddle's operators: any backend, any device). A backend prepares a drafter's
weights with Backend.prepare_drafter: the fused backend runs its own kernel for the weights that name one
(`fused`), every backend can run `weights.reference_pass(model)`. The proposers that draft with them are in
specgen/engine/proposers; what the rest of specgen knows of each method is its config.DRAFTERS entry.
"""
