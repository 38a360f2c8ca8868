package blob

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/minio/minio-go/v7"
)

// Deleting from an S3 store. Nodes delete from the same packs at once
// without a lock, by three rules:
//   - a deleter always adds a dead list to each pack it deletes from
//     first, whatever it does with the pack next;
//   - a node that rewrites a pack (copies its live blobs into a new one)
//     removes the old index, then lists the old pack's dead lists again
//     and adds to the new pack those it had not read (deletes that came
//     while it copied), and only then removes the rest of the old pack;
//   - a deleter lists the store again after its deletes and starts over
//     while a copy of a key it deletes is still live (one a concurrent
//     rewrite copied before it could learn of the delete).
//
// S3 reads what was written before it (strong read-after-write and list
// consistency), so for a delete of k from pack X racing a rewrite of X
// into Y, either the rewriter's second listing of X's dead lists comes
// after the deleter's dead list (and carries it to Y), or the deleter's
// next listing comes after the rewriter removed X's index, and so after Y
// was published: it finds k live in Y and deletes it there.

// s3DeleteRounds bounds the rounds of a delete.
const s3DeleteRounds = 8

// Delete deletes key's blob; a key not stored is not an error.
func (s *S3) Delete(ctx context.Context, key string) error {
	return s.DeleteKeys(ctx, []string{key})
}

// DeleteKeys deletes every copy of every key: each pack holding some is
// given a dead list, and then rewritten with its live blobs when more
// than half its bytes are dead, or removed when none is live. It also
// clears, once an hour old, the leftovers of commits cut short (packs
// without an index, incomplete uploads) and of removals (dead lists of
// packs without an index).
func (s *S3) DeleteKeys(ctx context.Context, keys []string) error {
	return s.deleteKeys(ctx, keys, time.Time{})
}

// DeleteStoredBefore is DeleteKeys for the copies stored before t only.
func (s *S3) DeleteStoredBefore(ctx context.Context, keys []string, t time.Time) error {
	if t.IsZero() {
		return nil
	}
	return s.deleteKeys(ctx, keys, t)
}

func (s *S3) deleteKeys(ctx context.Context, keys []string, before time.Time) error {
	raw, err := parseKeys(ctx, keys)
	if err != nil {
		return err
	}
	s.delMu.Lock()
	defer s.delMu.Unlock()
	for round := 1; ; round++ {
		if err := s.refresh(ctx, time.Now()); err != nil {
			return fmt.Errorf("delete blobs: %w", err)
		}
		doomed := map[*pack][]rawKey{}
		s.view.mu.RLock()
		for _, k := range raw {
			for l := s.view.keys[k]; l != nil; l = l.next {
				if before.IsZero() || l.p.stored.Before(before) {
					doomed[l.p] = append(doomed[l.p], k)
				}
			}
		}
		orphans := append([]s3Orphan(nil), s.orphans...)
		s.view.mu.RUnlock()
		if len(doomed) == 0 {
			s.clearOrphans(ctx, orphans)
			return nil
		}
		if round > s3DeleteRounds {
			return fmt.Errorf("delete blobs: %d packs still hold some of them after %d rounds (other nodes rewriting them all along?); try again", len(doomed), s3DeleteRounds)
		}
		for p, ks := range doomed {
			if err := s.retire(ctx, p, ks); err != nil {
				return fmt.Errorf("delete blobs: pack %s: %w", s.loc.object(packObject(p.id)), err)
			}
		}
	}
}

// retire marks ks dead in p with a dead list; then it removes p when
// nothing in it lives on, or rewrites it with its live blobs when more
// than half its bytes are dead.
func (s *S3) retire(ctx context.Context, p *pack, ks []rawKey) error {
	s.view.mu.RLock()
	dead := map[rawKey]bool{}
	for k := range p.dead {
		dead[k] = true
	}
	read := map[string]bool{}
	for name := range p.deadObjs {
		read[name] = true
	}
	s.view.mu.RUnlock()
	var fresh []rawKey
	for _, k := range ks {
		if !dead[k] {
			dead[k] = true
			fresh = append(fresh, k)
		}
	}
	if len(fresh) == 0 {
		return nil
	}
	name, err := s.putDead(ctx, p.id, fresh)
	if err != nil {
		return err
	}
	read[name] = true
	var live []packEntry
	var deadB int64
	for _, e := range p.entries {
		if dead[e.key] {
			deadB += e.size
		} else {
			live = append(live, e)
		}
	}
	if len(live) > 0 && 2*deadB <= p.bytes {
		return nil
	}
	var copied *pack
	if len(live) > 0 {
		// Copy the live blobs into a new pack before the old one goes. A
		// pack that cannot be read whole keeps its place (its dead list
		// is written): the blobs it holds fail their readers' checks.
		if copied, err = s.rewrite(ctx, p, live); err != nil {
			if ctx.Err() != nil {
				return err
			}
			slog.Warn("an S3 pack more than half dead could not be rewritten; its dead blobs are listed instead", "pack", s.loc.object(packObject(p.id)), "err", err)
			return nil
		}
	}
	// The index first: without it the rest is invisible.
	if err := s.remove(ctx, indexObject(p.id)); err != nil {
		return err
	}
	deads, err := s.listDead(ctx, p.id)
	if err != nil {
		return err
	}
	if copied != nil {
		// Deletes from p that came while its blobs were copied.
		in := map[rawKey]bool{}
		for _, e := range copied.entries {
			in[e.key] = true
		}
		var late []rawKey
		for _, name := range deads {
			if read[name] {
				continue
			}
			b, err := s.fetchSmall(ctx, name)
			if errors.Is(err, errNoObject) {
				// Another node retiring the same pack removed it once it
				// had carried it over to its own copy; the deleter that
				// wrote it looks again, and deletes from any copy, ours
				// too, what is still live.
				continue
			}
			if err != nil {
				return fmt.Errorf("carry the deletes of %s over to %s: %w", s.loc.object(packObject(p.id)), s.loc.object(packObject(copied.id)), err)
			}
			keys, err := decodeDead(b)
			if err != nil {
				slog.Warn("an S3 pack's dead list cannot be read; the blobs it deletes are treated as live", "dead list", s.loc.object(name), "err", err)
				continue
			}
			for _, k := range keys {
				if in[k] && !dead[k] {
					dead[k] = true
					late = append(late, k)
				}
			}
		}
		if len(late) > 0 {
			if _, err := s.putDead(ctx, copied.id, late); err != nil {
				return err
			}
		}
	}
	if err := s.remove(ctx, packObject(p.id)); err != nil {
		return err
	}
	return s.removeObjects(ctx, deads)
}

// listDead lists pack id's dead lists (names under the prefix).
func (s *S3) listDead(ctx context.Context, id string) ([]string, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var names []string
	for o := range s.client.ListObjects(ctx, s.loc.bucket, minio.ListObjectsOptions{Prefix: s.loc.prefix + s3DeadDir + id + "/", Recursive: true}) {
		if o.Err != nil {
			return nil, fmt.Errorf("list the dead lists of %s: %w", s.loc.object(packObject(id)), o.Err)
		}
		name := strings.TrimPrefix(o.Key, s.loc.prefix)
		if n := parseS3Name(name); n.kind == 'd' && n.id == id {
			names = append(names, name)
		}
	}
	return names, nil
}

// putDead adds a dead list of keys to pack id, and returns its name.
func (s *S3) putDead(ctx context.Context, id string, keys []rawKey) (string, error) {
	name := s3DeadDir + id + "/" + newPackID() + s3DeadExt
	b := encodeDead(keys)
	if err := s.upload(ctx, name, bytes.NewReader(b), int64(len(b))); err != nil {
		return "", fmt.Errorf("put dead list %s: %w", s.loc.object(name), err)
	}
	return name, nil
}

// rewrite copies p's live blobs, verified, into a new pack.
func (s *S3) rewrite(ctx context.Context, p *pack, live []packEntry) (*pack, error) {
	b := &s3Batch{s: s, entries: map[rawKey]packEntry{}}
	defer b.Abort()
	for _, e := range live {
		data, err := s.readBlob(ctx, e.key, loc{p: p, off: e.off, size: e.size})
		if err != nil {
			return nil, err
		}
		if err := b.Stage(ctx, e.key.String(), data); err != nil {
			return nil, err
		}
	}
	return b.commit(ctx)
}

// remove removes one object (a name under the prefix); a missing one is
// not an error.
func (s *S3) remove(ctx context.Context, name string) error {
	if err := s.client.RemoveObject(ctx, s.loc.bucket, s.loc.prefix+name, minio.RemoveObjectOptions{}); err != nil && !isNoObject(err) {
		return fmt.Errorf("remove %s: %w", s.loc.object(name), err)
	}
	return nil
}

// removeObjects removes objects (names under the prefix) in bulk.
func (s *S3) removeObjects(ctx context.Context, names []string) error {
	if len(names) == 0 {
		return nil
	}
	ch := make(chan minio.ObjectInfo, len(names))
	for _, n := range names {
		ch <- minio.ObjectInfo{Key: s.loc.prefix + n}
	}
	close(ch)
	for e := range s.client.RemoveObjects(ctx, s.loc.bucket, ch, minio.RemoveObjectsOptions{}) {
		if e.Err != nil && !isNoObject(e.Err) {
			return fmt.Errorf("remove %s: %w", s.loc.object(strings.TrimPrefix(e.ObjectName, s.loc.prefix)), e.Err)
		}
	}
	return nil
}

// clearOrphans removes, once an hour old, what commits cut short and
// removals left: packs without an index (a commit may be in progress),
// dead lists of packs without an index (a rewrite may be about to read
// them again), and incomplete uploads. A failure is only logged: the
// next delete tries again.
func (s *S3) clearOrphans(ctx context.Context, orphans []s3Orphan) {
	now := s.Now()
	var names []string
	for _, o := range orphans {
		if now.Sub(o.at) > staleStaging {
			names = append(names, o.name)
		}
	}
	if err := s.removeObjects(ctx, names); err != nil {
		slog.Warn("leftovers in an S3 blob store could not be removed", "store", s.loc.String(), "err", err)
	}
	lctx, cancel := context.WithCancel(ctx)
	defer cancel()
	for u := range s.client.ListIncompleteUploads(lctx, s.loc.bucket, s.loc.prefix+s3PacksDir, true) {
		if u.Err != nil {
			slog.Warn("incomplete uploads to an S3 blob store could not be listed", "store", s.loc.String(), "err", u.Err)
			return
		}
		if now.Sub(u.Initiated) > staleStaging {
			if err := s.client.RemoveIncompleteUpload(ctx, s.loc.bucket, u.Key); err != nil {
				slog.Warn("an incomplete upload to an S3 blob store could not be aborted", "object", "s3://"+s.loc.bucket+"/"+u.Key, "err", err)
			}
		}
	}
}
