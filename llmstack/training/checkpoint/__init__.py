"""Training checkpoints: the manager that saves and resumes runs (.manager), the files and their
manifest (.files), the DeepSpeed checkpoint engine that writes them (.engine), expert-parallel
shards (.experts) and DeepSpeed's universal format for resuming on another layout (.universal).

Nothing is imported here, so reading a checkpoint's files does not load DeepSpeed.
"""
