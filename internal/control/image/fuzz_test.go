package image

import (
	"errors"
	"path/filepath"
	"strings"
	"testing"

	"stasis/errdefs"
)

// FuzzParseRef: any string parses or is refused as invalid, never
// panicking; a reference that parses prints as a string that parses
// back to the same reference.
func FuzzParseRef(f *testing.F) {
	for _, s := range []string{
		"", "oci:", "oci:/a/b", "oci:/a/b:v2", "oci:/a:b:c", "oci::x", "oci:a:", "oci:/x/y:tag/with/slash",
		"docker-archive:", "docker-archive:/tmp/img.tar", "docker://", "docker://registry.example/team/app:v1",
		"docker://registry.example/team/app@sha256:" + strings.Repeat("a", 64), "docker://UPPER/case", "sha256:",
		"sha256:" + strings.Repeat("0", 64), "sha256:" + strings.Repeat("A", 64), "ubuntu:22.04", "\x00", "oci:\x00:\xff",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		r, err := ParseRef(s)
		if err != nil {
			if !errors.Is(err, errdefs.ErrInvalid) {
				t.Fatalf("ParseRef(%q): an error not of kind invalid: %v", s, err)
			}
			return
		}
		switch r.Transport {
		case TransportOCI, TransportArchive:
			if r.Path == "" {
				t.Fatalf("ParseRef(%q) = %+v: no path", s, r)
			}
		case TransportDocker:
			if r.Name == "" {
				t.Fatalf("ParseRef(%q) = %+v: no name", s, r)
			}
		case TransportDigest:
			if !digestRE.MatchString(r.Digest) {
				t.Fatalf("ParseRef(%q) = %+v: not a digest", s, r)
			}
		default:
			t.Fatalf("ParseRef(%q) = %+v: transport %q", s, r, r.Transport)
		}
		again, err := ParseRef(r.String())
		if err != nil || again != r {
			t.Fatalf("ParseRef(%q) = %+v prints as %q, which parses as %+v, %v", s, r, r.String(), again, err)
		}
	})
}

// FuzzCleanTarPath: a tar entry's name becomes a path inside the root or
// is refused; it never names the root's parent or anything above it, and
// a name with no ".." component is never refused.
func FuzzCleanTarPath(f *testing.F) {
	for _, s := range []string{"", ".", "/", "a", "a/b", "/etc/passwd", "../x", "a/../../x", "a/..", "./a//b/", "..", "a/.wh.b", "...", "a/..b", "\x00", "//.."} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, name string) {
		rel, err := clean(name)
		dotdot := false
		for _, c := range strings.Split(name, "/") {
			dotdot = dotdot || c == ".."
		}
		if err != nil {
			if !dotdot {
				t.Fatalf("clean(%q) refused a name with no \"..\": %v", name, err)
			}
			return
		}
		if dotdot {
			t.Fatalf("clean(%q) = %q: a name with \"..\" was let through", name, rel)
		}
		if rel == "" || strings.HasPrefix(rel, "/") {
			t.Fatalf("clean(%q) = %q: not a relative path", name, rel)
		}
		const root = "/root-of-image"
		if j := filepath.Join(root, rel); j != root && !strings.HasPrefix(j, root+"/") {
			t.Fatalf("clean(%q) = %q leaves the root: %s", name, rel, j)
		}
	})
}
