package store

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"stasis/errdefs"
	"stasis/internal/testwait"
)

// queueBehind holds s's write lock (SQLite's writes take turns in Go), runs
// n writes, each in its own goroutine, waits until all but the first are
// queued behind the first batch, then lets them go; it returns each
// write's error.
func queueBehind(t *testing.T, s *sqlStore, n int, write func(i int) error) []error {
	t.Helper()
	s.writeMu.Lock()
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() { errs[i] = write(i) })
	}
	testwait.Until(t, "the writes to queue", 30*time.Second, func() bool {
		s.batch.mu.Lock()
		defer s.batch.mu.Unlock()
		return len(s.batch.pending) == n-1
	})
	s.writeMu.Unlock()
	wg.Wait()
	return errs
}

// Writes that arrive while a batch is written go together in the next:
// 64 journal appends and 64 records, two batches each, every write
// there once.
func TestWritesShareCommits(t *testing.T) {
	ctx := context.Background()
	s, _ := backends[0].openTemp(t)
	const n = 64
	for i, err := range queueBehind(t, s, n, func(i int) error {
		_, err := s.AppendJournal(ctx, JournalEntry{Op: "o", Kind: "k", Episode: fmt.Sprintf("ep-%d", i)})
		return err
	}) {
		if err != nil {
			t.Fatalf("append %d: %v", i, err)
		}
	}
	if s.batch.batches != 2 {
		t.Fatalf("%d appends in %d batches, want 2", n, s.batch.batches)
	}
	es, err := s.Journal(ctx)
	if err != nil || len(es) != n {
		t.Fatalf("journal: %d entries, %v", len(es), err)
	}
	seqs := map[int64]bool{}
	for _, e := range es {
		seqs[e.Seq] = true
	}
	if len(seqs) != n {
		t.Fatalf("%d distinct numbers for %d entries", len(seqs), n)
	}
	if err := s.Begin(ctx, "A", nil); err != nil {
		t.Fatal(err)
	}
	for i, err := range queueBehind(t, s, n, func(i int) error { return s.Put(ctx, "A", rec(fmt.Sprintf("ep-%d", i), fmt.Sprintf("snap-%d", i))) }) {
		if err != nil {
			t.Fatalf("put %d: %v", i, err)
		}
	}
	if err := s.Commit(ctx, "A", n); err != nil {
		t.Fatal(err)
	}
}

// A write that fails in a batch fails alone: its companions are written,
// each caller is told its own outcome.
func TestAFailedWriteFailsAlone(t *testing.T) {
	ctx := context.Background()
	s, _ := backends[0].openTemp(t)
	for _, id := range []string{"open", "failed"} {
		if err := s.Begin(ctx, id, nil); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Fail(ctx, "failed", "a test"); err != nil {
		t.Fatal(err)
	}
	const n = 8
	errs := queueBehind(t, s, n, func(i int) error {
		ck := "open"
		if i == n/2 {
			ck = "failed"
		}
		return s.Put(ctx, ck, rec(fmt.Sprintf("ep-%d", i), fmt.Sprintf("snap-%d", i)))
	})
	for i, err := range errs {
		switch {
		case i == n/2 && !errors.Is(err, errdefs.ErrConflict):
			t.Errorf("the put into the failed checkpoint: %v", err)
		case i != n/2 && err != nil:
			t.Errorf("put %d beside it: %v", i, err)
		}
	}
	if _, recs, err := s.Get(ctx, "open"); err != nil || len(recs) != n-1 {
		t.Fatalf("the open checkpoint holds %d records, want %d: %v", len(recs), n-1, err)
	}
	if _, recs, err := s.Get(ctx, "failed"); err != nil || len(recs) != 0 {
		t.Fatalf("the failed checkpoint holds %d records: %v", len(recs), err)
	}
}
