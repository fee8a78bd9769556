"""Test support shipped with the package: in-memory fakes of the profile seams.

Nothing in the product imports this package; tests and contract suites do
(`from sfguard.supervisor.testing import FakeProfileLease`, ...).
"""
from sfguard.supervisor.testing.fakes import (
    FakeAuditSink,
    FakeKeyProvider,
    FakeLeaseState,
    FakeProfileLease,
    FakeProfileStore,
)

__all__ = ["FakeAuditSink", "FakeKeyProvider", "FakeLeaseState", "FakeProfileLease", "FakeProfileStore"]
