"""zoopick: pick the pretrained model of a zoo to reuse for a labelled image dataset, without
training any, then fine-tune it with sparse-communication data parallelism.

Sub-packages: ``selection`` and ``training`` (plain libraries), ``service`` (the core of the
web service), ``app`` (its HTTP face), ``workers`` (its Celery face), ``cli`` (the ``zoopick``
command). docs/ARCHITECTURE.md is the map.
"""

__version__ = "0.1.0"
