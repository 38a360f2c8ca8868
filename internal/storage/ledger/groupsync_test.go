package ledger

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	"stasis/internal/testwait"
)

// waitFor polls cond until it holds or the deadline passes.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	testwait.Until(t, what, 10*time.Second, cond)
}

// Appends that arrive while a flush is under way share the next flush, and
// that flush's outcome is each of theirs; the first flush's is its own.
func TestGroupSyncBatchesWaitersAndSharesTheOutcome(t *testing.T) {
	release := make(chan struct{})
	var mu sync.Mutex
	var batches [][]*os.File
	bad := errors.New("device gone")
	g := &syncGroup{flush: func(files []*os.File) error {
		mu.Lock()
		batches = append(batches, append([]*os.File(nil), files...))
		n := len(batches)
		mu.Unlock()
		if n == 1 {
			<-release
			return nil
		}
		return bad
	}}
	files := make([]*os.File, 6) // the flush is faked: they are only names
	for i := range files {
		f, err := os.CreateTemp(t.TempDir(), "f")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { f.Close() })
		files[i] = f
	}
	first := make(chan error, 1)
	go func() { first <- g.sync(files[0]) }()
	waitFor(t, "the first flush to start", func() bool { mu.Lock(); defer mu.Unlock(); return len(batches) == 1 })

	rest := make(chan error, len(files)-1)
	for _, f := range files[1:] {
		go func(f *os.File) { rest <- g.sync(f) }(f)
	}
	waitFor(t, "the others to join the next batch", func() bool {
		g.mu.Lock()
		defer g.mu.Unlock()
		return g.open != nil && len(g.open.files) == len(files)-1
	})
	select {
	case err := <-rest:
		t.Fatalf("an append returned before any flush covering it: %v", err)
	default:
	}
	close(release)
	if err := <-first; err != nil {
		t.Fatalf("first append: %v", err)
	}
	for range files[1:] {
		if err := <-rest; !errors.Is(err, bad) {
			t.Fatalf("an append of the failed batch returned %v", err)
		}
	}
	if len(batches) != 2 || len(batches[1]) != len(files)-1 {
		t.Fatalf("flushes %d, second batch %d files; want 2 flushes, the second of %d", len(batches), len(batches[1]), len(files)-1)
	}
	if g.busy || g.open != nil {
		t.Fatalf("group not idle after the flushes: busy %v, open %v", g.busy, g.open)
	}
	if g.flushes.Load() != 2 || g.synced.Load() != uint64(len(files)) {
		t.Fatalf("counters: %d flushes for %d appends", g.flushes.Load(), g.synced.Load())
	}
}

// Many episodes appending at once on a real file system: every entry is
// there and verifies after reopening, and appends shared flushes.
func TestConcurrentAppendsToManyLedgersShareFlushes(t *testing.T) {
	dir := t.TempDir()
	const episodes, each = 48, 6
	ls := make([]*Ledger, episodes)
	for i := range ls {
		ls[i] = open(t, dir, fmt.Sprint("ep", i))
	}
	g := ls[0].log.(*fileLog).group
	for _, l := range ls {
		if l.log.(*fileLog).group != g {
			t.Fatal("ledgers in one directory got different flush groups")
		}
	}
	flushes0, synced0 := g.flushes.Load(), g.synced.Load()
	var wg sync.WaitGroup
	errs := make(chan error, episodes*each)
	for i, l := range ls {
		wg.Add(1)
		go func(i int, l *Ledger) {
			defer wg.Done()
			for n := 1; n <= each; n++ {
				id := fmt.Sprintf("ep%d/%d", i, n)
				if _, err := l.Append(entry(id, chat(id))); err != nil {
					errs <- err
				}
			}
		}(i, l)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	flushes, synced := g.flushes.Load()-flushes0, g.synced.Load()-synced0
	if synced < episodes*each {
		t.Fatalf("the group covered %d appends; %d were made", synced, episodes*each)
	}
	t.Logf("%d appends, %d flushes", synced, flushes)
	if flushes >= synced {
		t.Errorf("%d flushes for %d concurrent appends: none were shared", flushes, synced)
	}
	for i, l := range ls {
		l.Close()
		ep := fmt.Sprint("ep", i)
		if rep, err := Verify(dir, ep); err != nil || !rep.OK || rep.Live != each {
			t.Fatalf("verify %s: %+v %v", ep, rep, err)
		}
	}
}
