package cas

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"sync"
	"time"

	"stasis/internal/storage/blob"
)

// Chunker cuts a stream into chunks: Next returns the next one, or io.EOF
// after the last. A returned chunk is the caller's; the Chunker does not
// touch it again. How it cuts is its own affair (the microVM provider cuts
// QEMU's migration stream by guest address); the chunks in order are the
// stream.
type Chunker interface {
	Next() ([]byte, error)
}

// Staged is a stream stored by StageFile and not yet durable: Commit
// makes it a snapshot, Abort forgets it.
type Staged struct {
	sn    *snapshotter
	pf    blob.PackFile
	m     *manifest
	start time.Time
	done  bool
}

// StageFile stores a stream its producer writes straight into pf, a pack
// file of this Store's blob store, as the content of a tree holding one
// regular file named file (mode 0600), ready for CatFile and Restore like
// any snapshot. The stream's bytes are not copied again: ch cuts the
// file's content from its start (while the producer is still writing,
// if ch waits for the bytes it needs), and the Store's workers hash the
// chunks while ch reads on, up to streamAhead chunks ahead of them.
// StageFile has stopped calling ch when it returns, whatever the outcome.
//
// A chunk not stored yet is kept where it lies in the file (its
// write-back starts at once); the bytes of one already stored, or kept
// earlier in the file, are dropped and take no space. Commit appends the
// manifest to pf and commits it; Abort, or a failure here, aborts it.
// Nothing is durable or visible before Commit. Stats.Bytes and ReadBytes
// are the stream's length; Stats.NewBytes counts the kept chunks (and the
// manifest), not the part-blocks a dropped stretch shares with its
// neighbours, which stay allocated.
//
// base, when not "", is a snapshot that every collection of the store
// keeps while this one is staged (a sandbox's published base: the state
// it was forked from, or its previous one): a chunk it references counts
// as stored however old its copy is (blob.AnyHaver), where the store's Has
// may report only recent copies (S3Options.ReuseWithin), so that what did
// not change since the base is not stored again. A base that is not in the
// store is staged without.
func (s *Store) StageFile(ctx context.Context, file string, pf blob.PackFile, ch Chunker, base string) (*Staged, error) {
	sn := &snapshotter{s: s, claimed: map[string]bool{}}
	if base != "" {
		if _, ok := s.blobs.(blob.AnyHaver); ok {
			keys, err := s.Chunks(ctx, base)
			if errors.Is(err, blob.ErrNotFound) {
				slog.Warn("stage stream: its base is not in the store; every chunk not stored recently is stored again", "file", file, "base", base)
			} else if err != nil {
				pf.Abort()
				return nil, fmt.Errorf("stage stream %s: its base %s: %w", file, base, err)
			} else {
				sn.base = make(map[string]bool, len(keys))
				for _, k := range keys {
					sn.base[k] = true
				}
			}
		}
	}
	st := &Staged{sn: sn, pf: pf, start: time.Now()}
	err := st.stage(ctx, file, ch, func(ctx context.Context, key string, off int64, data []byte) error {
		isNew, err := sn.claim(ctx, key)
		if err != nil {
			return err
		}
		if !isNew {
			return pf.Drop(off, int64(len(data)))
		}
		if err := pf.Keep(key, off, int64(len(data))); err != nil {
			return err
		}
		sn.stored(len(data))
		return nil
	})
	if err != nil {
		return nil, err
	}
	return st, nil
}

// stage runs ch's chunks through the Store's workers, each handing one
// chunk (its key, its offset in the stream, its bytes) to store, and
// builds the manifest of the one-file tree. On failure it aborts st and
// returns the error.
func (st *Staged) stage(ctx context.Context, file string, ch Chunker, store func(ctx context.Context, key string, off int64, data []byte) error) error {
	if checkPath(file) != nil || strings.Contains(file, "/") {
		st.Abort()
		return fmt.Errorf("stage stream: %q is not a file name", file)
	}
	sn, s := st.sn, st.sn.s
	type job struct {
		i    int
		off  int64
		data []byte
	}
	var (
		mu   sync.Mutex
		refs []chunkRef
		n    int64
	)
	ctx, cancel := context.WithCancel(ctx)
	next, wait := readAhead(ctx, ch, streamAhead)
	// The read-ahead ends, should the workers fail, before this returns:
	// the caller may free what ch reads as soon as it does.
	defer func() { cancel(); wait() }()
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
				j := job{i, n, c}
				n += int64(len(c))
				select {
				case jobs <- j:
				case <-ctx.Done():
					return ctx.Err()
				}
			}
		},
		func() func(context.Context, job) error {
			return func(ctx context.Context, j job) error {
				key := hashKey(j.data)
				if err := store(ctx, key, j.off, j.data); err != nil {
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
		return fmt.Errorf("stage stream %s: %w", file, err)
	}
	now := time.Now().UnixNano()
	root := meta{Mode: 0o700, UID: uint32(os.Getuid()), GID: uint32(os.Getgid()), Mtime: now}
	fm := meta{Mode: 0o600, UID: root.UID, GID: root.GID, Mtime: now}
	st.m = &manifest{Root: root, Entries: []entry{{Path: name(file), Type: typeFile, meta: fm, Size: n, Ctime: now, Chunks: refs}}}
	sn.st.Files, sn.st.Bytes, sn.st.ReadBytes = 1, n, n
	return nil
}

// streamAhead is how many chunks StageFile's cutting runs ahead of the
// hashing workers (the chunks of a mapped file cost no memory of their
// own): the cutting is not held back by a slow hash.
const streamAhead = 4096

// readAhead reads ch in a goroutine of its own, up to n chunks ahead of
// the returned next's caller; it stops at the end of the stream, at an
// error, or when ctx ends. wait returns once it has stopped calling ch.
func readAhead(ctx context.Context, ch Chunker, n int) (next func() ([]byte, error), wait func()) {
	type item struct {
		b   []byte
		err error
	}
	q := make(chan item, n)
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
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
	next = func() ([]byte, error) {
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
	return next, func() { <-stopped }
}

// Bytes is the length of the staged stream.
func (st *Staged) Bytes() int64 { return st.sn.st.Bytes }

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
	if err := st.pf.Append(id, b); err != nil {
		st.abort()
		return "", Stats{}, fmt.Errorf("commit stream: store manifest: %w", err)
	}
	if err := st.pf.Commit(ctx); err != nil {
		st.abort()
		return "", Stats{}, fmt.Errorf("commit stream: %w", err)
	}
	sn.stored(len(b))
	sn.s.setComplete(id)
	sn.st.Duration = time.Since(st.start)
	return id, sn.st, nil
}

// Abort drops what was staged. It is a no-op after Commit.
func (st *Staged) Abort() {
	if st.done {
		return
	}
	st.done = true
	st.abort()
}

func (st *Staged) abort() {
	st.pf.Abort()
}
