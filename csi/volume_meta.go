package csi

// What a volume records of itself: the metadata its image gets, and the
// volume context NodeStage receives.

// owner is a volume's PVC and PV, as the external-provisioner names them
// with --extra-create-metadata. Stored in the image's metadata under the
// same keys (ceph-csi's --setmetadata does the same), and passed to the
// node so the daemon's metrics can say which PVC a device serves.
type owner struct{ PVC, Namespace, PV string }

// The provisioner's keys, as parameters and as image metadata.
const (
	keyPVCName      = "csi.storage.k8s.io/pvc/name"
	keyPVCNamespace = "csi.storage.k8s.io/pvc/namespace"
	keyPVName       = "csi.storage.k8s.io/pv/name"
)

// meta is o as image metadata.
func (o owner) meta() map[string]string {
	m := map[string]string{}
	for k, v := range map[string]string{keyPVCName: o.PVC, keyPVCNamespace: o.Namespace, keyPVName: o.PV} {
		if v != "" {
			m[k] = v
		}
	}
	return m
}

// defaultFeatures: exclusive-lock is what lets RWO volumes map with the
// exclusive lock; object-map and fast-diff make used-bytes stats cheap.
func defaultFeatures() []string {
	return []string{"layering", "exclusive-lock", "object-map", "fast-diff", "deep-flatten"}
}

// volumeMeta is the metadata a new volume's image gets.
func volumeMeta(name, source, kind string, o owner) map[string]string {
	m := o.meta()
	m[metaName] = name
	if source != "" {
		m[metaSource] = source
	}
	if kind != "" {
		m[metaKind] = kind
	}
	return m
}

// volumeContext is what NodeStage needs of the StorageClass; it gets no
// parameters of its own.
func volumeContext(p params, vol volume) map[string]string {
	c := map[string]string{"clusterID": p.ClusterID, "pool": vol.Spec.Pool, "imageName": vol.Spec.Image}
	if vol.Spec.Namespace != "" {
		c["radosNamespace"] = vol.Spec.Namespace
	}
	if p.MkfsOptions != "" {
		c["mkfsOptions"] = p.MkfsOptions
	}
	if p.MapOptions != "" {
		c["mapOptions"] = "nbd:" + p.MapOptions
	}
	if p.Owner.PVC != "" {
		c["pvcName"], c["pvcNamespace"] = p.Owner.PVC, p.Owner.Namespace
	}
	p.Encryption.context(c)
	return c
}
