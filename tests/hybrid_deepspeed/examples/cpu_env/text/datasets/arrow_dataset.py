"""``Dataset``: a list of records with the ``filter``, ``map``, ``len`` and indexing the
HelloDeepSpeed script calls."""


class Dataset:
    def __init__(self, records):
        self._records = list(records)

    def filter(self, keep):
        return Dataset(r for r in self._records if keep(r))

    def map(self, fn):
        return Dataset({**r, **fn(r)} for r in self._records)

    def __len__(self):
        return len(self._records)

    def __getitem__(self, i):
        return self._records[i]
