package cas

import (
	"context"
	"fmt"
	"io"
	"io/fs"
)

// catAhead is how many chunks CatFile reads and verifies ahead of the one
// it writes.
const catAhead = 8

// CatFile writes the content of one regular file of snapshot id (its path
// relative to the tree's root, as Snapshot saw it) to w, in order, without
// materialising the tree: it is how a saved VM state streams into QEMU.
// Chunks are read and verified up to catAhead ahead of the writer; a
// damaged one ends the stream with an error wrapping ErrCorrupt, after the
// chunks before it were written.
func (s *Store) CatFile(ctx context.Context, id, path string, w io.Writer) error {
	m, err := s.loadManifest(ctx, id)
	if err != nil {
		return fmt.Errorf("cat: %w", err)
	}
	var e *entry
	for i := range m.Entries {
		if string(m.Entries[i].Path) == path {
			e = &m.Entries[i]
			break
		}
	}
	if e == nil || e.Type != typeFile {
		return fmt.Errorf("cat %s in snapshot %s: %w (no regular file of that path)", path, id, fs.ErrNotExist)
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	type result struct {
		data []byte
		err  error
	}
	// One channel per chunk, in order; a semaphore bounds the chunks in
	// flight.
	slots := make(chan chan result, catAhead)
	sem := make(chan struct{}, catAhead)
	go func() {
		defer close(slots)
		for _, ref := range e.Chunks {
			select {
			case sem <- struct{}{}:
			case <-ctx.Done():
				return
			}
			ch := make(chan result, 1)
			go func(ref chunkRef) {
				data, err := readChunk(ctx, s.blobs, ref)
				ch <- result{data, err}
			}(ref)
			select {
			case slots <- ch:
			case <-ctx.Done():
				return
			}
		}
	}()
	for ch := range slots {
		r := <-ch
		<-sem
		if r.err != nil {
			return fmt.Errorf("cat %s in snapshot %s: %w", path, id, r.err)
		}
		if _, err := w.Write(r.data); err != nil {
			return fmt.Errorf("cat %s in snapshot %s: %w", path, id, err)
		}
	}
	return ctx.Err()
}
