package task

import (
	"archive/tar"
	"compress/gzip"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// extractTar unpacks a tarball (plain or gzip'd) into dst. Entries that
// would land outside dst, links, and special files are refused.
func extractTar(src, dst string) error {
	f, err := os.Open(src)
	if err != nil {
		return err
	}
	defer f.Close()
	var r io.Reader = f
	var magic [2]byte
	if n, _ := io.ReadFull(f, magic[:]); n == 2 && magic == [2]byte{0x1f, 0x8b} {
		if _, err := f.Seek(0, io.SeekStart); err != nil {
			return err
		}
		gz, err := gzip.NewReader(f)
		if err != nil {
			return fmt.Errorf("%s: %w", src, err)
		}
		defer gz.Close()
		r = gz
	} else if _, err := f.Seek(0, io.SeekStart); err != nil {
		return err
	}
	root, err := os.OpenRoot(dst)
	if err != nil {
		return err
	}
	defer root.Close()
	tr := tar.NewReader(r)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("%s: %w", src, err)
		}
		name := filepath.Clean(strings.TrimPrefix(h.Name, "./"))
		if name == "." {
			continue
		}
		if filepath.IsAbs(name) || name == ".." || strings.HasPrefix(name, "../") {
			return fmt.Errorf("%s: entry %q lands outside the work tree", src, h.Name)
		}
		switch h.Typeflag {
		case tar.TypeDir:
			if err := root.MkdirAll(name, 0o755); err != nil {
				return err
			}
		case tar.TypeReg:
			if err := root.MkdirAll(filepath.Dir(name), 0o755); err != nil {
				return err
			}
			mode := os.FileMode(0o644)
			if h.FileInfo().Mode().Perm()&0o111 != 0 {
				mode = 0o755
			}
			w, err := root.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_EXCL, mode)
			if err != nil {
				return fmt.Errorf("%s: %w", src, err)
			}
			if _, err := io.Copy(w, tr); err != nil {
				_ = w.Close()
				return fmt.Errorf("%s: %w", src, err)
			}
			if err := w.Close(); err != nil {
				return err
			}
		default:
			return fmt.Errorf("%s: entry %q: only directories and regular files are taken (type %q)", src, h.Name, h.Typeflag)
		}
	}
}

// cloneBundle clones a git bundle into dst and checks out ref (HEAD when
// empty).
func cloneBundle(bundle, ref, dst string) error {
	if _, err := exec.LookPath("git"); err != nil {
		return errors.New("git is not installed: a git-bundle work tree needs it (apt-get install git)")
	}
	if err := git("", "clone", "--quiet", "--no-checkout", bundle, dst); err != nil {
		return err
	}
	if ref == "" {
		ref = "HEAD"
	}
	// A branch of the bundle is origin/BRANCH in the clone.
	commit, err := runGit(dst, nil, "rev-parse", "--verify", "--quiet", ref+"^{commit}")
	if err != nil {
		if commit, err = runGit(dst, nil, "rev-parse", "--verify", "--quiet", "origin/"+ref+"^{commit}"); err != nil {
			return fmt.Errorf("the bundle %s has no commit or branch %q", bundle, ref)
		}
	}
	return git(dst, "checkout", "--quiet", "--detach", commit)
}

// runGit runs git in dir with a fixed identity, no user or system
// configuration and the extra environment given, and returns its trimmed
// output; an error names the command and carries what git printed.
func runGit(dir string, env []string, args ...string) (string, error) {
	cmd := exec.Command("git", args...)
	cmd.Dir = dir
	cmd.Env = append(append(os.Environ(), "GIT_CONFIG_NOSYSTEM=1", "GIT_CONFIG_GLOBAL=/dev/null",
		"GIT_AUTHOR_NAME=stasis", "GIT_AUTHOR_EMAIL=stasis@localhost",
		"GIT_COMMITTER_NAME=stasis", "GIT_COMMITTER_EMAIL=stasis@localhost", "GIT_TERMINAL_PROMPT=0"), env...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("git %s: %v: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return strings.TrimSpace(string(out)), nil
}

// gitRaw is runGit's stdout, whole and untrimmed (stderr goes into the
// error only).
func gitRaw(dir string, env []string, args ...string) (string, error) {
	cmd := exec.Command("git", args...)
	cmd.Dir = dir
	cmd.Env = append(append(os.Environ(), "GIT_CONFIG_NOSYSTEM=1", "GIT_CONFIG_GLOBAL=/dev/null", "GIT_TERMINAL_PROMPT=0"), env...)
	var errb strings.Builder
	cmd.Stderr = &errb
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("git %s: %v: %s", strings.Join(args, " "), err, strings.TrimSpace(errb.String()))
	}
	return string(out), nil
}

func git(dir string, args ...string) error {
	_, err := runGit(dir, nil, args...)
	return err
}
