"""`torchloom k8s train|serve`: Kubernetes manifests built from a torchloom config, and their submission.

manifests.py: the pieces every pod shares (names, resources, placement, the Secret, YAML) · job.py: the Indexed
Job and headless Service of a torchrun training · deployment.py: the Deployment and Service of `torchloom serve` ·
apply.py: `--apply` through the `kubernetes` client (the k8s extra) · command.py: the command line.
Nothing here imports torch, train/ or engines/: the manifests are built from the config alone.
"""
