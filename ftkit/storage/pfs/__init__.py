"""The parallel-file-system level: self-describing HDF5 steps (``level``: PfsLevel; ``hdf5``:
the layout and writers; ``h5read``: the verifying reader; ``h5files``: file digests and
checks; ``h5sink``: the file object new HDF5 files are written through)."""
