"""Scoring files with an exported model: on this machine (`files`: the input read in bounded batches, the output
written whole) or on Spark (`spark`: `mapInArrow`, the model loaded once per executor Python process). What both
share is `files`'s. Nothing here imports serve/, train/ or etl/.
"""
