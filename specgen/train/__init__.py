"""Training a DeepSeek-V3-style MTP head for any model by self-distillation (`specgen train-mtp`).

data.py     prompts -> the main model's greedy continuations and the hidden states the engine feeds the head
windows.py  training windows over the cached sequences, batches, the vocabulary shortlist
head.py     the trainable head (the engine's MtpHead math, in Paddle with autograd) and its export
trainer.py  the loop: AdamW with warmup + cosine, held-out evaluation, checkpoints, loss.csv, the final save
plot.py     loss.csv -> loss.png
"""
