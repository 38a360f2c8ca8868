package store

import (
	"context"
	"database/sql"
	"errors"
	"sync"
	"time"
)

// Group commit of small writes.
//
// A prepare over thousands of episodes writes, for each, two journal
// notes, the episode's row and its record: four transactions, each a
// BEGIN, the node's lease check, the statement and a COMMIT that waits
// for the log's flush. Writes that arrive while another batch is being
// written wait and go together in the next one: one transaction, one
// lease check, one flush. Each caller still returns only once its own
// write is committed (or has failed), so nothing is reported durable
// early.
//
// A write that fails inside a batch rolls the whole batch back; its
// companions, which may have done nothing wrong, are then written each in
// a transaction of its own, and each caller gets its own write's outcome.
// So are the writes of a batch that kept conflicting with other writers
// (PostgreSQL's serialization failures) until its tries ran out: a bigger
// transaction conflicts more often.
// An error of the transaction itself (the commit, the lease, the
// connection) is every caller's: the batch may or may not have been
// committed, and writing it again would write twice.

// maxBatch bounds the writes of one batch.
const maxBatch = 256

// batchTimeout bounds one batch's transaction: its callers wait for it
// whatever their own contexts say (a write reported failed must not be
// committed afterwards).
const batchTimeout = 2 * time.Minute

// batcher queues writes for the next batch.
type batcher struct {
	mu      sync.Mutex
	pending []*batchWrite
	leading bool // a goroutine writes batches until the queue is empty
	batches int  // batches written (tests)
}

// batchWrite is one caller's write.
type batchWrite struct {
	fn   func(*sql.Tx) error
	done chan error
}

// opError is a write's own failure inside a batch.
type opError struct {
	i   int
	err error
}

func (e *opError) Error() string { return e.err.Error() }
func (e *opError) Unwrap() error { return e.err }

// write runs fn in a write transaction shared with the writes of other
// goroutines waiting at the same time; fn must set its results afresh each
// time it runs (a batch may run again after a conflict, or fn alone after
// a companion's failure).
func (s *sqlStore) write(ctx context.Context, fn func(*sql.Tx) error) error {
	w := &batchWrite{fn: fn, done: make(chan error, 1)}
	s.batch.mu.Lock()
	s.batch.pending = append(s.batch.pending, w)
	lead := !s.batch.leading
	s.batch.leading = true
	s.batch.mu.Unlock()
	if lead {
		s.lead(ctx)
	}
	return <-w.done
}

// lead writes one batch of the queue, then hands the queue on to a new
// leader if writes arrived meanwhile.
func (s *sqlStore) lead(ctx context.Context) {
	s.batch.mu.Lock()
	s.batch.batches++
	n := min(len(s.batch.pending), maxBatch)
	ws := s.batch.pending[:n:n]
	s.batch.pending = s.batch.pending[n:]
	s.batch.mu.Unlock()

	bctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), batchTimeout)
	s.writeBatch(bctx, ws)
	cancel()

	s.batch.mu.Lock()
	more := len(s.batch.pending) > 0
	s.batch.leading = more
	s.batch.mu.Unlock()
	if more {
		go s.lead(ctx)
	}
}

// writeBatch writes ws in one transaction and tells each its outcome.
func (s *sqlStore) writeBatch(ctx context.Context, ws []*batchWrite) {
	if len(ws) == 1 {
		ws[0].done <- s.tx(ctx, false, ws[0].fn)
		return
	}
	err := s.tx(ctx, false, func(tx *sql.Tx) error {
		for i, w := range ws {
			if err := w.fn(tx); err != nil {
				return &opError{i: i, err: err}
			}
		}
		return nil
	})
	var oe *opError
	conflicted := err != nil && s.d.retry != nil && s.d.retry(err)
	if !errors.As(err, &oe) && !conflicted {
		for _, w := range ws {
			w.done <- err
		}
		return
	}
	// One write failed, or the batch kept conflicting with other writers
	// until its tries ran out; either way it was rolled back: each alone.
	for _, w := range ws {
		w.done <- s.tx(ctx, false, w.fn)
	}
}
