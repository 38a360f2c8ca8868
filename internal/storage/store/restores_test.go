package store

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"stasis/errdefs"
	"stasis/internal/pgtest"
)

// A restore over two nodes goes once both are ready, and not before; a
// share readied twice is refused; a failed share aborts it, and a share
// readied after that changes nothing.
func TestRestoreShares(t *testing.T) {
	ctx := context.Background()
	s := openPostgres(t, pgtest.DSN(t))
	ns := joinAll(t, s, time.Minute, "a", "b")
	plan := map[string][]string{"a": {"ep-a"}, "b": {"ep-b"}}
	if err := s.BeginRestore(ctx, "r1", "ck", plan, ns); err != nil {
		t.Fatal(err)
	}
	if st, err := s.AsNode(ns[0]).ReadyRestoreShare(ctx, "r1", "a", ""); err != nil || st != RestorePending {
		t.Fatalf("a ready: %s %v", st, err)
	}
	if _, err := s.AsNode(ns[0]).ReadyRestoreShare(ctx, "r1", "a", ""); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("a ready twice: %v", err)
	}
	if st, err := s.AsNode(ns[1]).ReadyRestoreShare(ctx, "r1", "b", ""); err != nil || st != RestoreGo {
		t.Fatalf("b ready: %s %v", st, err)
	}
	if err := s.BeginRestore(ctx, "r2", "ck", plan, ns); err != nil {
		t.Fatal(err)
	}
	if st, err := s.AsNode(ns[1]).ReadyRestoreShare(ctx, "r2", "b", "fork failed"); err != nil || st != RestoreAborted {
		t.Fatalf("b failed: %s %v", st, err)
	}
	if st, err := s.AsNode(ns[0]).ReadyRestoreShare(ctx, "r2", "a", ""); err != nil || st != RestoreAborted {
		t.Fatalf("a ready after the abort: %s %v", st, err)
	}
	r, shares, err := s.GetRestore(ctx, "r2")
	if err != nil || r.State != RestoreAborted || !strings.Contains(r.Error, "node b: fork failed") || len(shares) != 2 || shares[0].State != SharePending {
		t.Fatalf("r2: %+v %+v %v", r, shares, err)
	}
	if _, _, err := s.GetRestore(ctx, "nope"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("an unknown restore: %v", err)
	}
}

// A node whose lease runs out while its share is ready, before the
// restore went, calls the restore off: the last share readied aborts it
// rather than letting it go (nobody would continue the dead node's
// episodes), and so does AbortLapsedRestore.
func TestRestoreAbortedWhenAReadyNodeLapses(t *testing.T) {
	ctx := context.Background()
	s := openPostgres(t, pgtest.DSN(t))
	live := joinAll(t, s, time.Minute, "a")[0]
	dying := joinAll(t, s, time.Second, "b")[0]
	plan := map[string][]string{"a": {"ep-a"}, "b": {"ep-b"}}
	for _, id := range []string{"r1", "r2"} {
		if err := s.BeginRestore(ctx, id, "ck", plan, []Node{live, dying}); err != nil {
			t.Fatal(err)
		}
		if st, err := s.AsNode(dying).ReadyRestoreShare(ctx, id, "b", ""); err != nil || st != RestorePending {
			t.Fatalf("%s: b ready: %s %v", id, st, err)
		}
	}
	if aborted, err := s.AbortLapsedRestore(ctx, "r1"); err != nil || aborted {
		t.Fatalf("AbortLapsedRestore while b's lease runs: %v %v", aborted, err)
	}
	waitLapsed(t, s, "b")
	if st, err := s.AsNode(live).ReadyRestoreShare(ctx, "r1", "a", ""); err != nil || st != RestoreAborted {
		t.Fatalf("r1: a ready after b lapsed: %s %v", st, err)
	}
	if aborted, err := s.AbortLapsedRestore(ctx, "r2"); err != nil || !aborted {
		t.Fatalf("r2: AbortLapsedRestore after b lapsed: %v %v", aborted, err)
	}
	for _, id := range []string{"r1", "r2"} {
		if r, _, err := s.GetRestore(ctx, id); err != nil || r.State != RestoreAborted || !strings.Contains(r.Error, "lease of node b ran out before the restore went") {
			t.Fatalf("%s: %+v %v", id, r, err)
		}
	}
	if aborted, err := s.AbortLapsedRestore(ctx, "r2"); err != nil || aborted {
		t.Fatalf("AbortLapsedRestore of an aborted restore: %v %v", aborted, err)
	}
}
