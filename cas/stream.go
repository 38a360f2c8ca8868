package cas

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"time"

	"stasis/blob"
)

// Chunker cuts a stream into chunks: Next returns the next one, or io.EOF
// after the last. A returned chunk is the caller's; the Chunker does not
// touch it again. How it cuts is its own affair (the microVM provider cuts
// QEMU's migration stream by guest address); the chunks in order are the
// stream.
type Chunker interface {
	Next() ([]byte, error)
}

// Staged is a stream stored by StageStream and not yet durable: Commit
// makes it a snapshot, Abort forgets it.
type Staged struct {
	sn    *snapshotter
	m     *manifest
	start time.Time
	done  bool
}

// StageStream stores the stream ch cuts, as the content of a tree holding
// one regular file named file (mode 0600), ready for CatFile and Restore like any
// snapshot. Chunks are hashed, deduplicated and written by the Store's
// workers while ch reads on, up to streamAhead chunks ahead of them. It
// returns when every chunk is staged, or at the first failure;
// nothing is durable, and with a batching blob store nothing is visible,
// until Commit. Stats.Bytes and ReadBytes are the stream's length.
func (s *Store) StageStream(ctx context.Context, file string, ch Chunker) (*Staged, error) {
	if checkPath(file) != nil || strings.Contains(file, "/") {
		return nil, fmt.Errorf("stage stream: %q is not a file name", file)
	}
	sn := &snapshotter{s: s, claimed: map[string]bool{}}
	if b, ok := s.blobs.(blob.Batcher); ok {
		sn.batch = b.NewBatch()
	}
	st := &Staged{sn: sn, start: time.Now()}
	type job struct {
		i    int
		data []byte
	}
	var (
		mu   sync.Mutex
		refs []chunkRef
		n    int64
	)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel() // ends the read-ahead, should the workers fail
	next := readAhead(ctx, ch, streamAhead)
	err := fanOut(ctx, s.workers,
		func(ctx context.Context, jobs chan job) error {
			for {
				c, err := next()
				if errors.Is(err, io.EOF) {
					return nil
				}
				if err != nil {
					return fmt.Errorf("read the stream: %w", err)
				}
				if len(c) == 0 {
					continue
				}
				mu.Lock()
				i := len(refs)
				refs = append(refs, chunkRef{Size: int64(len(c))})
				mu.Unlock()
				n += int64(len(c))
				select {
				case jobs <- job{i, c}:
				case <-ctx.Done():
					return ctx.Err()
				}
			}
		},
		func() func(context.Context, job) error {
			return func(ctx context.Context, j job) error {
				key := hashKey(j.data)
				if err := sn.put(ctx, key, j.data); err != nil {
					return err
				}
				mu.Lock()
				refs[j.i].Key = key
				mu.Unlock()
				return nil
			}
		})
	if err != nil {
		st.Abort()
		return nil, fmt.Errorf("stage stream %s: %w", file, err)
	}
	now := time.Now().UnixNano()
	root := meta{Mode: 0o700, UID: uint32(os.Getuid()), GID: uint32(os.Getgid()), Mtime: now}
	fm := meta{Mode: 0o600, UID: root.UID, GID: root.GID, Mtime: now}
	st.m = &manifest{Root: root, Entries: []entry{{Path: name(file), Type: typeFile, meta: fm, Size: n, Ctime: now, Chunks: refs}}}
	sn.st.Files, sn.st.Bytes, sn.st.ReadBytes = 1, n, n
	return st, nil
}

// streamAhead is how many chunks StageStream reads ahead of the workers
// (at 256 KiB a chunk, up to 1 GiB): the stream's writer is not held back
// by hashing and writing; a VM being saved goes on as soon as QEMU has
// written its state.
const streamAhead = 4096

// readAhead reads ch in a goroutine of its own, up to n chunks ahead of
// the returned function's caller; it stops at the end of the stream, at
// an error, or when ctx ends.
func readAhead(ctx context.Context, ch Chunker, n int) func() ([]byte, error) {
	type item struct {
		b   []byte
		err error
	}
	q := make(chan item, n)
	go func() {
		defer close(q)
		for {
			b, err := ch.Next()
			select {
			case q <- item{b, err}:
			case <-ctx.Done():
				return
			}
			if err != nil {
				return
			}
		}
	}()
	return func() ([]byte, error) {
		select {
		case it, ok := <-q:
			if !ok {
				return nil, ctx.Err()
			}
			return it.b, it.err
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// Commit stores the manifest and makes it and every chunk durable (and
// visible) at once; it returns the snapshot's id.
func (st *Staged) Commit(ctx context.Context) (string, Stats, error) {
	if st.done {
		return "", Stats{}, errors.New("commit: the stream was already committed or aborted")
	}
	st.done = true
	sn := st.sn
	b := st.m.encode()
	if _, err := decodeManifest(b); err != nil {
		return "", Stats{}, fmt.Errorf("commit stream: %w", err)
	}
	id := hashKey(b)
	if err := sn.put(ctx, id, b); err != nil {
		st.abort()
		return "", Stats{}, fmt.Errorf("commit stream: store manifest: %w", err)
	}
	if sn.batch != nil {
		if err := sn.batch.Commit(ctx); err != nil {
			st.abort()
			return "", Stats{}, fmt.Errorf("commit stream: %w", err)
		}
	}
	sn.s.setComplete(id)
	sn.st.Duration = time.Since(st.start)
	return id, sn.st, nil
}

// Abort drops what was staged (with a batching blob store; otherwise the
// blobs written stay until a GC finds nothing references them). It is a
// no-op after Commit.
func (st *Staged) Abort() {
	if st.done {
		return
	}
	st.done = true
	st.abort()
}

func (st *Staged) abort() {
	if st.sn.batch != nil {
		st.sn.batch.Abort()
	}
}
