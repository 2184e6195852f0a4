package csi

import (
	"errors"
	"fmt"
	"net/url"
	"strings"

	"github.com/rbd-nbd-go/rbd-nbd-go/ceph"
)

// A volume ID names the image and the cluster it lives on, so every call
// finds it without a lookup table: "nbd1/CLUSTER/POOL/NAMESPACE/IMAGE",
// each part path-escaped (NAMESPACE may be empty). A static volume's
// handle is written the same way by hand.
const volIDPrefix = "nbd1"

// volume is a decoded volume ID.
type volume struct {
	ClusterID string
	Spec      ceph.ImageSpec
}

func (v volume) ID() string {
	parts := []string{volIDPrefix, v.ClusterID, v.Spec.Pool, v.Spec.Namespace, v.Spec.Image}
	for i := 1; i < len(parts); i++ {
		parts[i] = url.PathEscape(parts[i])
	}
	return strings.Join(parts, "/")
}

// errBadVolumeID: not one of our IDs. Callers answer NotFound (the
// volume cannot exist), or success for DeleteVolume.
var errBadVolumeID = errors.New("not a volume ID of this driver")

func parseVolumeID(id string) (volume, error) {
	parts := strings.Split(id, "/")
	if len(parts) != 5 || parts[0] != volIDPrefix {
		return volume{}, fmt.Errorf("%q: %w (want %s/CLUSTER/POOL/NAMESPACE/IMAGE)", id, errBadVolumeID, volIDPrefix)
	}
	for i := 1; i < 5; i++ {
		p, err := url.PathUnescape(parts[i])
		if err != nil {
			return volume{}, fmt.Errorf("%q: %w", id, errBadVolumeID)
		}
		parts[i] = p
	}
	v := volume{ClusterID: parts[1], Spec: ceph.ImageSpec{Pool: parts[2], Namespace: parts[3], Image: parts[4]}}
	// The spec must survive its string form (pool/ns/image) unchanged.
	if v.ClusterID == "" || v.Spec.Pool == "" || v.Spec.Image == "" ||
		strings.ContainsAny(v.Spec.Pool+v.Spec.Namespace+v.Spec.Image, "/@") {
		return volume{}, fmt.Errorf("%q: %w", id, errBadVolumeID)
	}
	return v, nil
}
