package image

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/mutate"

	"stasis/errdefs"
	"stasis/internal/flock"
	"stasis/internal/storage/atomicfile"
)

// Image is one unpacked image, as image.json in its directory says.
type Image struct {
	// Digest is the image's config digest (sha256:HEX): its identity.
	Digest string `json:"digest"`
	// Manifest is the manifest digest it was last pulled with.
	Manifest string `json:"manifest,omitempty"`
	// Refs are the references it was pulled as, newest last.
	Refs []string `json:"refs,omitempty"`
	// Env, WorkingDir and User are the image config's.
	Env        []string `json:"env,omitempty"`
	WorkingDir string   `json:"working_dir,omitempty"`
	User       string   `json:"user,omitempty"`
	// IDBase is the host id of the image's uid and gid 0.
	IDBase   int       `json:"id_base"`
	Unpacked time.Time `json:"unpacked"`
	// Bytes, Files, Dirs, Links: what the unpacked root holds; Devices
	// the device nodes left out.
	Bytes   int64 `json:"bytes"`
	Files   int   `json:"files"`
	Dirs    int   `json:"dirs"`
	Links   int   `json:"links"`
	Devices int   `json:"devices,omitempty"`
	// Root is the unpacked root file system on the host.
	Root string `json:"-"`
}

// Ref is the reference the image was last pulled as ("" when none is
// known).
func (im Image) Ref() string {
	if len(im.Refs) == 0 {
		return ""
	}
	return im.Refs[len(im.Refs)-1]
}

// Errors of Remove and GC.
var (
	// ErrNotFound: no image of that digest is in the store.
	ErrNotFound = errNotPulled
	// ErrInUse: a sandbox or a checkpoint's record uses the image.
	ErrInUse = errdefs.Errorf(errdefs.ErrConflict, "in use")
	// ErrBusy: the image is being pulled.
	ErrBusy = errdefs.Errorf(errdefs.ErrConflict, "being pulled")
)

// Store is the directory of unpacked images, $STASIS_HOME/images:
// DIGESTDIR/image.json and DIGESTDIR/rootfs for each, where DIGESTDIR is
// sha256-HEX. A directory without image.json is an unpack that did not
// finish; nothing reads it, and GC removes it.
type Store struct {
	dir    string
	idBase int
}

// DefaultIDBase is the host id that the images' id 0 becomes: the local
// provider's default user-namespace base, so that its sandboxes see the
// images' own owners.
const DefaultIDBase = 1 << 30

// Files and directories in the store.
const (
	metaName   = "image.json"
	rootfsName = "rootfs"
	tmpPrefix  = ".unpack-"
)

// Open opens (making it if missing) the image store of state directory
// home; idBase is the host id the images' id 0 becomes (the local
// provider's user namespaces map it to 0).
func Open(home string, idBase int) (*Store, error) {
	if home == "" {
		return nil, errors.New("image store: no state directory")
	}
	dir := filepath.Join(home, "images")
	// 0711: the sandboxes' namespaces reach a root through it, and list
	// nothing.
	if err := os.MkdirAll(dir, 0o711); err != nil {
		return nil, err
	}
	return &Store{dir: dir, idBase: idBase}, nil
}

// Dir is the store's directory.
func (s *Store) Dir() string { return s.dir }

func dirName(digest string) string { return strings.Replace(digest, ":", "-", 1) }

func (s *Store) path(digest string) string { return filepath.Join(s.dir, dirName(digest)) }

// Get returns the unpacked image of a digest (sha256:HEX).
func (s *Store) Get(digest string) (Image, error) {
	if !digestRE.MatchString(digest) {
		return Image{}, fmt.Errorf("image %q: not a digest (sha256: and 64 lowercase hex digits)", digest)
	}
	d := s.path(digest)
	b, err := os.ReadFile(filepath.Join(d, metaName))
	if errors.Is(err, os.ErrNotExist) {
		return Image{}, fmt.Errorf("image %s: %w: `stasis image pull REF` unpacks it", digest, ErrNotFound)
	}
	if err != nil {
		return Image{}, err
	}
	var im Image
	if err := json.Unmarshal(b, &im); err != nil {
		return Image{}, fmt.Errorf("image %s: %s: %w", digest, metaName, err)
	}
	if im.Digest != digest {
		return Image{}, fmt.Errorf("image %s: %s names %s", digest, metaName, im.Digest)
	}
	if im.IDBase != s.idBase {
		return Image{}, fmt.Errorf("image %s was unpacked for host id base %d, not %d: remove it (`stasis image rm %s`) and pull it again", digest, im.IDBase, s.idBase, digest)
	}
	im.Root = filepath.Join(d, rootfsName)
	return im, nil
}

// List returns every unpacked image, newest first.
func (s *Store) List() ([]Image, error) {
	ents, err := os.ReadDir(s.dir)
	if err != nil {
		return nil, err
	}
	var out []Image
	for _, e := range ents {
		dg, ok := strings.CutPrefix(e.Name(), "sha256-")
		if !ok || !e.IsDir() {
			continue
		}
		im, err := s.Get("sha256:" + dg)
		if err != nil {
			continue // unfinished, or not ours
		}
		out = append(out, im)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Unpacked.After(out[j].Unpacked) })
	return out, nil
}

// Progress reports an unpack's advance: bytes and files written so far.
type Progress func(bytes int64, files int)

// Resolve returns the unpacked image a reference names, pulling and
// unpacking it first when its digest is not in the store. A digest
// reference is looked up only.
func (s *Store) Resolve(ctx context.Context, ref string, progress Progress) (Image, error) {
	r, err := ParseRef(ref)
	if err != nil {
		return Image{}, err
	}
	if r.Transport == TransportDigest {
		return s.Get(r.Digest)
	}
	return s.pull(ctx, r, progress)
}

// Pull reads a reference's image and unpacks it unless its digest is
// there already (then it only records the reference).
func (s *Store) Pull(ctx context.Context, ref string, progress Progress) (Image, error) {
	r, err := ParseRef(ref)
	if err != nil {
		return Image{}, err
	}
	if !r.Pullable() {
		return s.Get(r.Digest)
	}
	return s.pull(ctx, r, progress)
}

func (s *Store) pull(ctx context.Context, r Ref, progress Progress) (Image, error) {
	img, err := r.open(ctx)
	if err != nil {
		return Image{}, err
	}
	cfgName, err := img.ConfigName()
	if err != nil {
		return Image{}, fmt.Errorf("image %s: its config: %w", r, err)
	}
	digest := cfgName.String()
	unlock, err := flock.Lock(s.path(digest)+".lock", true)
	if err != nil {
		return Image{}, err
	}
	defer unlock()
	if im, err := s.Get(digest); err == nil {
		return s.addRef(im, r.String())
	} else if !errors.Is(err, ErrNotFound) {
		return Image{}, err
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return Image{}, fmt.Errorf("image %s: its config: %w", r, err)
	}
	if cf.OS != "" && cf.OS != platform.OS || cf.Architecture != "" && cf.Architecture != platform.Architecture {
		return Image{}, fmt.Errorf("image %s is for %s/%s; sandboxes run %s", r, cf.OS, cf.Architecture, platform.String())
	}
	im := Image{Digest: digest, Refs: []string{r.String()}, Env: cf.Config.Env, WorkingDir: cf.Config.WorkingDir, User: cf.Config.User, IDBase: s.idBase}
	if m, err := img.Digest(); err == nil {
		im.Manifest = m.String()
	}
	tmp, err := os.MkdirTemp(s.dir, tmpPrefix+dirName(digest)+"-")
	if err != nil {
		return Image{}, err
	}
	ok := false
	defer func() {
		if !ok {
			_ = os.RemoveAll(tmp)
		}
	}()
	rootfs := filepath.Join(tmp, rootfsName)
	st, err := s.unpack(ctx, r, img, rootfs, progress)
	if err != nil {
		return Image{}, err
	}
	im.Bytes, im.Files, im.Dirs, im.Links, im.Devices = st.Bytes, st.Files, st.Dirs, st.Links, st.Devices
	im.Unpacked = time.Now().UTC()
	if err := atomicfile.SyncFS(rootfs); err != nil {
		return Image{}, err
	}
	if err := atomicfile.WriteJSON(filepath.Join(tmp, metaName), im, 0o644); err != nil {
		return Image{}, err
	}
	final := s.path(digest)
	if err := os.Rename(tmp, final); err != nil {
		return Image{}, fmt.Errorf("image %s: %w", r, err)
	}
	ok = true
	if err := atomicfile.SyncDir(s.dir); err != nil {
		return Image{}, err
	}
	im.Root = filepath.Join(final, rootfsName)
	return im, nil
}

// unpack makes rootfs, owned by the image's root, and unpacks img's
// layers into it.
func (s *Store) unpack(ctx context.Context, r Ref, img v1.Image, rootfs string, progress Progress) (unpackStats, error) {
	if err := os.Mkdir(rootfs, 0o755); err != nil {
		return unpackStats{}, err
	}
	if err := os.Lchown(rootfs, s.idBase, s.idBase); err != nil {
		return unpackStats{}, err
	}
	root, err := os.OpenRoot(rootfs)
	if err != nil {
		return unpackStats{}, err
	}
	defer root.Close()
	u := &unpacker{root: root, idBase: s.idBase}
	if progress != nil {
		u.progress = func(st unpackStats) { progress(st.Bytes, st.Files) }
	}
	rc := mutate.Extract(img)
	err = u.run(ctx, rc)
	rc.Close()
	if err != nil {
		return unpackStats{}, fmt.Errorf("image %s: %w", r, err)
	}
	return u.stats, nil
}

// addRef records that im was pulled as ref.
func (s *Store) addRef(im Image, ref string) (Image, error) {
	refs := []string{}
	for _, r := range im.Refs {
		if r != ref {
			refs = append(refs, r)
		}
	}
	im.Refs = append(refs, ref)
	if err := atomicfile.WriteJSON(filepath.Join(s.path(im.Digest), metaName), im, 0o644); err != nil {
		return Image{}, err
	}
	return im, nil
}

// InUse says why an image may not be removed ("" when it may).
type InUse func(digest string) (reason string, err error)

// Remove deletes an unpacked image unless inUse names a user of it.
func (s *Store) Remove(digest string, inUse InUse) error {
	if _, err := s.Get(digest); err != nil {
		return err
	}
	unlock, err := flock.TryLock(s.path(digest) + ".lock")
	if errors.Is(err, flock.ErrHeld) {
		return fmt.Errorf("image %s is %w; try again when that ends", digest, ErrBusy)
	}
	if err != nil {
		return err
	}
	defer unlock()
	if inUse != nil {
		why, err := inUse(digest)
		if err != nil {
			return err
		}
		if why != "" {
			return fmt.Errorf("image %s is %w: %s", digest, ErrInUse, why)
		}
	}
	return s.removeDir(s.path(digest))
}

// removeDir removes an image directory: first renamed out of the way (so
// no half-removed image is ever read), then deleted.
func (s *Store) removeDir(d string) error {
	gone := filepath.Join(s.dir, tmpPrefix+"rm-"+filepath.Base(d))
	if err := os.Rename(d, gone); err != nil {
		return err
	}
	return os.RemoveAll(gone)
}

// GC removes every image inUse does not name a user of, and what
// interrupted unpacks and removals left; it returns the digests removed.
func (s *Store) GC(inUse InUse) ([]string, error) {
	ents, err := os.ReadDir(s.dir)
	if err != nil {
		return nil, err
	}
	var removed []string
	for _, e := range ents {
		n := e.Name()
		switch {
		case strings.HasPrefix(n, tmpPrefix):
			// An unpack in progress holds its digest's lock.
			dg := strings.TrimPrefix(strings.TrimPrefix(n, tmpPrefix), "rm-")
			if i := strings.LastIndexByte(dg, '-'); i > len("sha256-") && len(dg) > len("sha256-")+64 {
				dg = dg[:i]
			}
			unlock, err := flock.TryLock(filepath.Join(s.dir, dg) + ".lock")
			if err != nil {
				continue
			}
			err = os.RemoveAll(filepath.Join(s.dir, n))
			unlock()
			if err != nil {
				return removed, err
			}
		case strings.HasPrefix(n, "sha256-") && e.IsDir():
			digest := "sha256:" + strings.TrimPrefix(n, "sha256-")
			if _, err := s.Get(digest); err != nil {
				continue
			}
			err := s.Remove(digest, inUse)
			if errors.Is(err, ErrInUse) || errors.Is(err, ErrBusy) {
				continue
			}
			if err != nil {
				return removed, err
			}
			removed = append(removed, digest)
			_ = os.Remove(s.path(digest) + ".lock")
		}
	}
	return removed, nil
}
