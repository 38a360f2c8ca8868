package ledger

import (
	"fmt"
	"os"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"
)

// Group commit. Every append must be on disk before it returns, and each
// episode has its own file, so a gateway serving many episodes at once
// would flush the disk once per append. Instead, appends to ledgers on one
// file system that wait for their flush at the same time share it: the
// first one flushes alone (fsync of its file, exactly as before, so a lone
// caller waits no longer), and every append that arrives while that flush
// is under way joins the next batch, which is made durable by one syncfs(2)
// of the file system once the flush before it has finished. syncfs writes
// back and waits for every dirty page and inode of the file system, the
// ledgers' included, then commits the journal and flushes the device, so
// each member of the batch is as durable as its own fsync would have made
// it. One flush for many appends cuts the CPU a relayed call costs (about
// 90 µs less per append at 512 concurrent episodes on the 2-core machine
// BENCHMARKS.md describes).
//
// The price: syncfs also writes back whatever else is dirty on that file
// system, so a batch that coincides with a bulk write (a snapshot being
// staged on the same disk, as in `stasis serve`, whose state directory
// holds both) waits for it. A lone append never does.
//
// An error from a batch's flush is every member's error: none of them is
// known to be on disk, and each ledger stops writing (see Ledger.err).

// syncGroup is the group commit of one file system.
type syncGroup struct {
	flush func(files []*os.File) error

	mu   sync.Mutex
	busy bool   // a batch is being flushed
	open *batch // the batch that arrivals join; nil when none

	flushes, synced atomic.Uint64 // flushes made, and appends they covered
}

// batch is the appends that share one flush.
type batch struct {
	files []*os.File
	turn  chan struct{} // closed when the flush before this batch is done
	led   bool          // a member has taken the flush on
	done  chan struct{} // closed when the flush is done; err is then set
	err   error
}

// sync returns once f's written data is on disk, flushing alone or in a
// batch. A batch opened while the group is idle has its turn at once.
func (g *syncGroup) sync(f *os.File) error {
	g.mu.Lock()
	if g.open == nil {
		g.open = &batch{turn: make(chan struct{}), done: make(chan struct{})}
		if !g.busy {
			g.busy = true
			close(g.open.turn)
		}
	}
	b := g.open
	b.files = append(b.files, f)
	g.mu.Unlock()
	select {
	case <-b.done:
		return b.err
	case <-b.turn:
	}
	// The flush before this batch is done (or there was none): the first
	// member here flushes the batch, with everyone who joined it until then.
	g.mu.Lock()
	if b.led {
		g.mu.Unlock()
		<-b.done
		return b.err
	}
	b.led = true
	if g.open == b {
		g.open = nil
	}
	g.mu.Unlock()
	g.run(b)
	return b.err
}

// run flushes b (whose member list no longer changes) and hands the turn to
// the batch that gathered meanwhile, or marks the group idle.
func (g *syncGroup) run(b *batch) {
	b.err = g.flush(b.files)
	g.flushes.Add(1)
	g.synced.Add(uint64(len(b.files)))
	close(b.done)
	g.mu.Lock()
	if g.open != nil {
		close(g.open.turn) // busy stays set: a member of that batch flushes it
	} else {
		g.busy = false
	}
	g.mu.Unlock()
}

// flushFiles makes files durable: one fsync for one file, one syncfs of
// their (shared) file system for more.
func flushFiles(files []*os.File) error {
	if len(files) == 1 {
		if err := files[0].Sync(); err != nil {
			return fmt.Errorf("fsync: %w", err)
		}
		return nil
	}
	if err := unix.Syncfs(int(files[0].Fd())); err != nil {
		return fmt.Errorf("syncfs (flushing %d ledgers together): %w", len(files), err)
	}
	return nil
}

// groups holds one syncGroup per file system (device number), made on
// first use and kept for the life of the process.
var groups sync.Map // uint64 → *syncGroup

// groupFor returns the group commit of the file system that holds f.
func groupFor(f *os.File) (*syncGroup, error) {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return nil, fmt.Errorf("stat %s: %w", f.Name(), err)
	}
	g, _ := groups.LoadOrStore(st.Dev, &syncGroup{flush: flushFiles})
	return g.(*syncGroup), nil
}

// Flushes reports, over every file system this process's ledgers are on,
// how many flushes were made and how many writes (appends, cuts) they made
// durable: their ratio is how many writes a flush shared.
func Flushes() (flushes, writes uint64) {
	groups.Range(func(_, v any) bool {
		g := v.(*syncGroup)
		flushes += g.flushes.Load()
		writes += g.synced.Load()
		return true
	})
	return flushes, writes
}
