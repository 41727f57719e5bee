"""Datasets for a public run (``docs/DESIGN.md`` section 11): a corpus prepared once into
token shards and an index whose hash is the dataset id.

- ``index.py``: the index, the dataset id, and the check of shards against it;
- ``prepare.py``: ``swarmloco data prepare``, text, JSONL or parquet into shards.
"""
