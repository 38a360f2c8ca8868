package store

import (
	"context"
	"database/sql"
	"errors"
	"strings"
	"testing"
	"time"

	"stasis/errdefs"
	"stasis/internal/pgtest"
	"stasis/internal/testwait"
)

func openPostgres(t *testing.T, dsn string) *Postgres {
	t.Helper()
	s, err := OpenPostgres(context.Background(), dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

// waitLapsed waits until node name's lease has run out.
func waitLapsed(t *testing.T, s *Postgres, name string) {
	t.Helper()
	testwait.Until(t, "node "+name+"'s lease to run out", 30*time.Second, func() bool {
		ns, err := s.Nodes(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		for _, n := range ns {
			if n.Name == name {
				return !n.Live
			}
		}
		return false
	})
}

func TestNodesJoinRenewLeave(t *testing.T) {
	ctx := context.Background()
	s := openPostgres(t, pgtest.DSN(t))
	a, err := s.Join(ctx, "node-a", "http://10.0.0.1:8080", time.Minute)
	if err != nil || a.Epoch != 1 || !a.Live || a.Addr != "http://10.0.0.1:8080" {
		t.Fatalf("join: %+v %v", a, err)
	}
	if _, err := s.Join(ctx, "node-a", "", time.Minute); !errors.Is(err, errdefs.ErrConflict) || !strings.Contains(err.Error(), "another stasis serve runs under that name") {
		t.Fatalf("a second join of a live name: %v", err)
	}
	for _, bad := range []string{"", "-x", "a/b", strings.Repeat("n", 64)} {
		if _, err := s.Join(ctx, bad, "", time.Minute); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("join %q: %v", bad, err)
		}
	}
	r, err := s.Renew(ctx, a, 2*time.Minute)
	if err != nil || !r.LeaseUntil.After(a.LeaseUntil) {
		t.Fatalf("renew: %+v %v", r, err)
	}
	if err := s.Leave(ctx, a); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Renew(ctx, a, time.Minute); !errors.Is(err, ErrLeaseLost) {
		t.Fatalf("renew after leaving: %v", err)
	}
	// The name is free again: a new epoch.
	a2, err := s.Join(ctx, "node-a", "", time.Minute)
	if err != nil || a2.Epoch != 2 {
		t.Fatalf("join again: %+v %v", a2, err)
	}
	ns, err := s.Nodes(ctx)
	if err != nil || len(ns) != 1 || ns[0].Epoch != 2 || !ns[0].Live {
		t.Fatalf("nodes: %+v %v", ns, err)
	}
}

// A node whose lease ran out while it still runs (cut off, or stalled)
// writes nothing more: no record, no commit, no episode, no journal; and
// once its name joins again, the old epoch stays out even while the new
// one is live.
func TestPartitionedNodeCannotWrite(t *testing.T) {
	ctx := context.Background()
	s := openPostgres(t, pgtest.DSN(t))
	n, err := s.Join(ctx, "node-p", "", time.Second)
	if err != nil {
		t.Fatal(err)
	}
	p := s.AsNode(n)
	if err := p.Begin(ctx, "A", nil); err != nil {
		t.Fatal(err)
	}
	if err := p.Put(ctx, "A", rec("ep-0", "snap-0")); err != nil {
		t.Fatal(err)
	}
	waitLapsed(t, s, "node-p")
	for what, err := range map[string]error{
		"put":     p.Put(ctx, "A", rec("ep-1", "snap-1")),
		"commit":  p.Commit(ctx, "A", 1),
		"fail":    p.Fail(ctx, "A", "x"),
		"begin":   p.Begin(ctx, "B", nil),
		"episode": p.PutEpisode(ctx, Episode{ID: "ep-0", State: EpisodeRunning}),
	} {
		if !errors.Is(err, ErrLeaseLost) {
			t.Errorf("%s by a node whose lease ran out: %v", what, err)
		}
	}
	if _, err := p.AppendJournal(ctx, JournalEntry{Op: "o", Kind: "k"}); !errors.Is(err, ErrLeaseLost) {
		t.Errorf("journal: %v", err)
	}
	c, recs, err := s.Get(ctx, "A")
	if err != nil || c.State != StatePending || len(recs) != 1 {
		t.Fatalf("the checkpoint after the refused writes: %+v %d %v", c, len(recs), err)
	}
	// The name joins again (the server restarted): the old epoch's
	// writes stay refused, the new one's go through.
	n2, err := s.Join(ctx, "node-p", "", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Put(ctx, "A", rec("ep-1", "snap-1")); !errors.Is(err, ErrLeaseLost) {
		t.Fatalf("the old epoch's put: %v", err)
	}
	if _, err := s.Renew(ctx, n, time.Minute); !errors.Is(err, ErrLeaseLost) {
		t.Fatalf("the old epoch's renew: %v", err)
	}
	if err := s.AsNode(n2).Put(ctx, "A", rec("ep-1", "snap-1")); err != nil {
		t.Fatal(err)
	}
	// Reads do not need a lease.
	if _, _, err := p.Get(ctx, "A"); err != nil {
		t.Fatal(err)
	}
}

// A node's writes do not hold up its heartbeat: a renewal goes through
// while a write transaction of the node is open (and its connections
// are all busy), but a new epoch of its name joining after its lease ran
// out waits for that write to end, so an old epoch's write never commits
// after a new epoch joined.
func TestRenewDoesNotWaitForTheNodesWrites(t *testing.T) {
	ctx := context.Background()
	dsn := pgtest.DSN(t)
	s := openPostgres(t, dsn)
	n := joinAll(t, s, 2*time.Second, "a")[0]
	v := s.AsNode(n)
	const open = 32 // every connection of the pool
	entered, release := make(chan struct{}, open), make(chan struct{})
	wrote := make(chan error, open)
	for range open {
		go func() {
			wrote <- v.tx(ctx, false, func(*sql.Tx) error {
				entered <- struct{}{}
				<-release
				return nil
			})
		}()
	}
	for range open {
		<-entered
	}
	rctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	if _, err := s.Renew(rctx, n, 2*time.Second); err != nil {
		t.Fatalf("renew while the node's writes are open: %v", err)
	}
	// The node's pool is taken by its writes: look, and join, from
	// another process's store.
	other := openPostgres(t, dsn)
	waitLapsed(t, other, "a")
	joined := make(chan error, 1)
	go func() {
		_, err := other.Join(ctx, "a", "", time.Minute)
		joined <- err
	}()
	testwait.Until(t, "the new epoch's join to wait for the old epoch's writes", 30*time.Second, func() bool {
		var waiting int
		err := other.leases.QueryRowContext(ctx, `SELECT COUNT(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%FOR UPDATE%'`).Scan(&waiting)
		return err == nil && waiting == 1
	})
	select {
	case err := <-joined:
		t.Fatalf("the join did not wait for the open writes: %v", err)
	default:
	}
	close(release)
	for range open {
		if err := <-wrote; err != nil {
			t.Fatalf("a write begun under the lease: %v", err)
		}
	}
	if err := <-joined; err != nil {
		t.Fatal(err)
	}
	if _, err := v.AppendJournal(ctx, JournalEntry{Op: "op", Kind: "k"}); !errors.Is(err, ErrLeaseLost) {
		t.Fatalf("the old epoch writes after the new one joined: %v", err)
	}
}
