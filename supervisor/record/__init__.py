"""The run record (issue 48): what a stage did with its browser, beside the guard's decisions.

  summary   what an entry says of a command, an address or typed text (no secret in it)
  files     one run's folder in the guard home: the timeline (JSON lines, hash-chained, appended
            as the run goes), its screenshots, its index (covered by the audit chain)
  tabs      the guard's own view of a stage's tabs on the browser's pipe: navigations, loads,
            screenshots, the focused field
  recorder  the guard's recorder: every source (gate, pipe, write gate, approvals, audit,
            decision log) into each run's timeline, with levels, a size cap and a retention
  tail      the decision log followed as it grows (the proxies' decisions of each run)
  shared    the index (and the record) in the shared PostgreSQL store
  view      entries as a person reads them (filters, links), the export archive
  watch     a read-only view of a stage's tab for a console session
Why: docs/decisions/0011-run-record.md.
"""
