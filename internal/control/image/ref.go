// Package image owns sandbox images: the references a user gives
// (oci:PATH[:TAG], docker-archive:PATH, docker://HOST/REPO:TAG, and
// sha256:HEX for one already unpacked), reading them with
// go-containerregistry, and the store of unpacked root file systems under
// $STASIS_HOME/images, one per image digest, that every sandbox using the
// image shares read-only.
//
// An image's digest here is its config's digest (what docker calls the
// image id): the same image read from a layout, an archive or a registry
// has one digest, and so one unpacked copy.
package image

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"stasis/errdefs"
	"strings"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// The transports of a reference.
const (
	TransportOCI     = "oci"
	TransportArchive = "docker-archive"
	TransportDocker  = "docker"
	TransportDigest  = "sha256"
)

// Ref is a parsed image reference.
type Ref struct {
	Transport string
	// Path of an OCI layout directory or a docker archive.
	Path string
	// Tag in an OCI layout (its org.opencontainers.image.ref.name), if
	// given.
	Tag string
	// Name is a registry reference (HOST/REPO:TAG or @sha256:…), for
	// TransportDocker.
	Name string
	// Digest, for TransportDigest: sha256:HEX.
	Digest string
}

var digestRE = regexp.MustCompile(`^sha256:[0-9a-f]{64}$`)

// refHelp says what forms a reference takes.
const refHelp = "use oci:PATH[:TAG] (an OCI image layout directory), docker-archive:PATH (what `docker save` writes), docker://HOST/REPO:TAG (a registry) or sha256:HEX (an image already pulled; `stasis image ls` lists them)"

// ParseRef parses an image reference.
func ParseRef(s string) (Ref, error) {
	switch {
	case s == "":
		return Ref{}, errdefs.Errorf(errdefs.ErrInvalid, "an empty image reference: %s", refHelp)
	case strings.HasPrefix(s, "oci:"):
		p := strings.TrimPrefix(s, "oci:")
		r := Ref{Transport: TransportOCI, Path: p}
		// A tag follows the last colon when what precedes it is the
		// layout (a path may hold colons of its own).
		if i := strings.LastIndexByte(p, ':'); i > 0 && !strings.Contains(p[i+1:], "/") {
			if _, err := os.Stat(filepath.Join(p, "index.json")); err != nil {
				r.Path, r.Tag = p[:i], p[i+1:]
				// "oci:PATH:" is neither PATH untagged (it would print
				// as another reference) nor a tag.
				if r.Tag == "" {
					return Ref{}, errdefs.Errorf(errdefs.ErrInvalid, "image %q: an empty tag after the last \":\" (give oci:PATH:TAG, or oci:PATH for a layout's only image)", s)
				}
			}
		}
		if r.Path == "" {
			return Ref{}, errdefs.Errorf(errdefs.ErrInvalid, "image %q: no layout directory after \"oci:\"", s)
		}
		return r, nil
	case strings.HasPrefix(s, "docker-archive:"):
		p := strings.TrimPrefix(s, "docker-archive:")
		if p == "" {
			return Ref{}, errdefs.Errorf(errdefs.ErrInvalid, "image %q: no archive path after \"docker-archive:\"", s)
		}
		return Ref{Transport: TransportArchive, Path: p}, nil
	case strings.HasPrefix(s, "docker://"):
		n := strings.TrimPrefix(s, "docker://")
		if _, err := name.ParseReference(n, name.StrictValidation); err != nil {
			return Ref{}, errdefs.Errorf(errdefs.ErrInvalid, "image %q: %v (give docker://HOST/REPO:TAG or docker://HOST/REPO@sha256:HEX)", s, err)
		}
		return Ref{Transport: TransportDocker, Name: n}, nil
	case strings.HasPrefix(s, "sha256:"):
		if !digestRE.MatchString(s) {
			return Ref{}, errdefs.Errorf(errdefs.ErrInvalid, "image %q: a digest is sha256: and 64 lowercase hex digits", s)
		}
		return Ref{Transport: TransportDigest, Digest: s}, nil
	}
	return Ref{}, errdefs.Errorf(errdefs.ErrInvalid, "image %q: unknown form; %s", s, refHelp)
}

func (r Ref) String() string {
	switch r.Transport {
	case TransportOCI:
		if r.Tag != "" {
			return "oci:" + r.Path + ":" + r.Tag
		}
		return "oci:" + r.Path
	case TransportArchive:
		return "docker-archive:" + r.Path
	case TransportDocker:
		return "docker://" + r.Name
	}
	return r.Digest
}

// Pullable says whether the reference names a source an image can be read
// from again (not a bare digest).
func (r Ref) Pullable() bool { return r.Transport != TransportDigest }

// platform is the one sandboxes run.
var platform = v1.Platform{OS: "linux", Architecture: "amd64"}

// open reads the image a reference names (not for TransportDigest).
func (r Ref) open(ctx context.Context) (v1.Image, error) {
	switch r.Transport {
	case TransportOCI:
		return r.openLayout()
	case TransportArchive:
		if _, err := os.Stat(r.Path); err != nil {
			return nil, fmt.Errorf("image %s: %w", r, err)
		}
		img, err := tarball.ImageFromPath(r.Path, nil)
		if err != nil {
			return nil, fmt.Errorf("image %s: not a docker archive with one image (%w)", r, err)
		}
		return img, nil
	case TransportDocker:
		ref, err := name.ParseReference(r.Name, name.StrictValidation)
		if err != nil {
			return nil, err
		}
		img, err := remote.Image(ref, remote.WithContext(ctx), remote.WithAuthFromKeychain(authn.DefaultKeychain), remote.WithPlatform(platform))
		if err != nil {
			return nil, fmt.Errorf("image %s: %w", r, err)
		}
		return img, nil
	}
	return nil, fmt.Errorf("image %s: a digest names an image already pulled, not a source to pull from", r)
}

// refName is the annotation that tags a manifest in an OCI layout.
const refName = "org.opencontainers.image.ref.name"

func (r Ref) openLayout() (v1.Image, error) {
	if _, err := os.Stat(filepath.Join(r.Path, "index.json")); err != nil {
		return nil, fmt.Errorf("image %s: %s is not an OCI image layout (no index.json): %w", r, r.Path, err)
	}
	lp, err := layout.FromPath(r.Path)
	if err != nil {
		return nil, fmt.Errorf("image %s: %w", r, err)
	}
	idx, err := lp.ImageIndex()
	if err != nil {
		return nil, fmt.Errorf("image %s: %w", r, err)
	}
	im, err := idx.IndexManifest()
	if err != nil {
		return nil, fmt.Errorf("image %s: index.json: %w", r, err)
	}
	var picked []v1.Descriptor
	var tags []string
	for _, d := range im.Manifests {
		tag := d.Annotations[refName]
		if tag != "" {
			tags = append(tags, tag)
		}
		if r.Tag == "" || tag == r.Tag {
			picked = append(picked, d)
		}
	}
	sort.Strings(tags)
	switch {
	case len(picked) == 0 && r.Tag != "":
		return nil, fmt.Errorf("image %s: no manifest tagged %q in the layout (tags: %s)", r, r.Tag, strings.Join(tags, ", "))
	case len(picked) == 0:
		return nil, fmt.Errorf("image %s: the layout holds no image", r)
	case len(picked) > 1:
		return nil, fmt.Errorf("image %s: the layout holds %d images; name one with oci:%s:TAG (tags: %s)", r, len(picked), r.Path, strings.Join(tags, ", "))
	}
	d := picked[0]
	if d.MediaType.IsIndex() {
		child, err := idx.ImageIndex(d.Digest)
		if err != nil {
			return nil, fmt.Errorf("image %s: %w", r, err)
		}
		return pickPlatform(r, child)
	}
	if !d.MediaType.IsImage() {
		return nil, fmt.Errorf("image %s: the manifest %s is a %s, not an image", r, d.Digest, d.MediaType)
	}
	img, err := lp.Image(d.Digest)
	if err != nil {
		return nil, fmt.Errorf("image %s: %w", r, err)
	}
	return img, nil
}

// pickPlatform takes linux/amd64 out of a multi-platform index.
func pickPlatform(r Ref, idx v1.ImageIndex) (v1.Image, error) {
	im, err := idx.IndexManifest()
	if err != nil {
		return nil, err
	}
	var have []string
	for _, d := range im.Manifests {
		if d.Platform == nil {
			continue
		}
		if d.Platform.Satisfies(platform) && d.MediaType.IsImage() {
			return idx.Image(d.Digest)
		}
		have = append(have, d.Platform.String())
	}
	return nil, fmt.Errorf("image %s: no %s image in its index (it has: %s)", r, platform.String(), strings.Join(have, ", "))
}

// errNotPulled is wrapped when an image is not in the store.
var errNotPulled = errdefs.Errorf(errdefs.ErrNotFound, "image not pulled")
