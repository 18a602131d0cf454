"""Reading the inputs: where an input is and what it is (locate.py), its formats (formats.py) and
encodings (encoding.py), files read by Spark or by tasks that stream a store's objects (read.py, store_read.py,
store_tasks.py), tables at a pinned version (tables.py, table_tasks.py). read.who_reads decides who reads an input.
"""
