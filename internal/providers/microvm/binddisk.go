package microvm

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"sort"
	"strings"
)

// BindDisk is a host directory given to a guest read-only: an erofs block
// image of it, attached as a virtio-blk device whose serial names it, and
// mounted at Path by the guest's boot script (the microVM's counterpart of
// a local sandbox's read-only bind). A fork attaches the same file, so
// DiskID is checked as the root image's is.
type BindDisk struct {
	Source string `json:"source"` // the host directory
	Path   string `json:"path"`   // where the guest sees it
	Disk   string `json:"disk"`   // the erofs image of Source
	DiskID string `json:"disk_id"`
	// Manifest is Disk stored in a shared store (see storeDisks), set in
	// a snapshot's record.
	Manifest string `json:"manifest,omitempty"`
}

// bindSerial is the virtio serial of the i-th bind disk (the root's is
// rootSerial); the guest finds its disks by serial, not by probe order.
func bindSerial(i int) string { return fmt.Sprintf("stasis-bind%d", i) }

const rootSerial = "stasis-root"

// checkBindPath refuses guest paths the boot script could not mount on
// safely: relative ones, the root, the guest's own mounts, the agent's
// writable places, and characters the kernel command line or the shell
// would split on.
func checkBindPath(p string) error {
	if !strings.HasPrefix(p, "/") || path.Clean(p) != p || p == "/" {
		return fmt.Errorf("read-only bind at %q: give an absolute, clean path other than /", p)
	}
	for _, r := range p {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || strings.ContainsRune("/._-", r)) {
			return fmt.Errorf("read-only bind at %q: only letters, digits and /._- may be in a guest path", p)
		}
	}
	for _, own := range []string{"/proc", "/sys", "/dev", "/tmp", "/work", "/stasis/bin", AgentHome} {
		if p == own || strings.HasPrefix(p, own+"/") || strings.HasPrefix(own, p+"/") {
			return fmt.Errorf("read-only bind at %q: %s is the guest's own", p, own)
		}
	}
	return nil
}

// bindDisks makes (or finds, built before) the erofs image of every read-only
// bind, in cacheDir, named by a digest of the directory's listing (names,
// modes, sizes, times, link targets): a directory that changed gets a new
// image, and one that did not is not built again.
func bindDisks(ctx context.Context, cacheDir string, binds map[string]string) ([]BindDisk, error) {
	var out []BindDisk
	for src, dst := range binds {
		if err := checkBindPath(dst); err != nil {
			return nil, err
		}
		disk, err := bindImage(ctx, cacheDir, src)
		if err != nil {
			return nil, fmt.Errorf("read-only bind %s → %s: %w", src, dst, err)
		}
		id, err := fileID(disk)
		if err != nil {
			return nil, err
		}
		out = append(out, BindDisk{Source: src, Path: dst, Disk: disk, DiskID: id})
	}
	// Parents before children, and one order for one set of binds.
	sort.Slice(out, func(i, j int) bool { return out[i].Path < out[j].Path })
	return out, nil
}

// treeDigest digests dir's listing (not its contents: a file rewritten in
// place keeps its size only by chance, and never its time).
func treeDigest(dir string) (string, error) {
	h := sha256.New()
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		link := ""
		if d.Type()&fs.ModeSymlink != 0 {
			if link, err = os.Readlink(p); err != nil {
				return err
			}
		}
		fmt.Fprintf(h, "%q %o %d %d %q\n", rel, fi.Mode(), fi.Size(), fi.ModTime().UnixNano(), link)
		return nil
	})
	if err != nil {
		return "", err
	}
	return hex.EncodeToString(h.Sum(nil))[:20], nil
}

// bindImage returns the erofs image of dir in cacheDir, building it once
// (under a lock; an interrupted build leaves a temporary file only).
func bindImage(ctx context.Context, cacheDir, dir string) (string, error) {
	fi, err := os.Stat(dir)
	if err != nil {
		return "", err
	}
	if !fi.IsDir() {
		return "", fmt.Errorf("%s is not a directory", dir)
	}
	sum, err := treeDigest(dir)
	if err != nil {
		return "", fmt.Errorf("read %s: %w", dir, err)
	}
	out := filepath.Join(cacheDir, "bind-"+sum+".erofs")
	if err := os.MkdirAll(cacheDir, 0o700); err != nil {
		return "", err
	}
	err = buildOnce(out, filepath.Join(cacheDir, "bind.lock"), func(tmp string) error {
		mkfs, err := exec.LookPath("mkfs.erofs")
		if err != nil {
			return errors.New("mkfs.erofs is missing: install it with `apt-get install erofs-utils` (make installs it)")
		}
		if b, err := exec.CommandContext(ctx, mkfs, "--quiet", "--preserve-mtime", "--all-root", "-x1", tmp, dir).CombinedOutput(); err != nil {
			return fmt.Errorf("mkfs.erofs: %v: %s", err, strings.TrimSpace(string(b)))
		}
		return nil
	})
	if err != nil {
		return "", err
	}
	return out, nil
}

// checkBindDisks says whether a saved machine's bind disks are still the
// very files it had.
func checkBindDisks(binds []BindDisk) error {
	for _, b := range binds {
		id, err := fileID(b.Disk)
		if err != nil {
			return fmt.Errorf("the block image %s of %s (seen at %s) is missing: %w", b.Disk, b.Source, b.Path, err)
		}
		if id != b.DiskID {
			return fmt.Errorf("the block image %s of %s (seen at %s) was built again since", b.Disk, b.Source, b.Path)
		}
	}
	return nil
}
