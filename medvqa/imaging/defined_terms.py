"""DICOM defined terms of the coded attributes a scan may carry (deid.py's allowlist), as data.

A coded attribute (VR CS) is 16 upper-case letters, digits, spaces and underscores: the form alone
lets a site's free text through ("ZZPHI_BODYPART", a surname in BodyPartExamined). So each value must
also be one of the standard's terms for that attribute; anything else is dropped. A term missing
here only means a legitimate value is not shown, never that identifying text is.

Sources: PS3.3 C.7.3.1.1.1 (Modality), PS3.16 Annex L / CID 4031 (Body Part Examined, as written in
BodyPartExamined), PS3.3 C.7.6.1.1.2 and the modality-specific modules (Image Type), C.7.3.1.1.2
(Patient Position), C.8.11.5.1 / C.8.11.7 (View Position), C.7.3.1 and C.7.6.2 (Laterality),
C.7.6.3.1.2 (Photometric Interpretation), C.11.1.1.2 (Rescale Type), C.8.3.1 (MR), C.7.6.1.1.5 and
C.7.6.1.1.6 (lossy compression, burned-in annotation).
"""

from __future__ import annotations


def _terms(text: str) -> frozenset[str]:
    return frozenset(term.strip() for term in text.split(",") if term.strip())


MODALITY = _terms("""
    AR, ASMT, AU, BDUS, BI, BMD, CFM, CR, CT, CTPROTOCOL, DG, DMS, DOC, DX, ECG, EEG, EMG, EOG, EPS, ES,
    FID, GM, HC, HD, IO, IOL, IVOCT, IVUS, KER, KO, LEN, LS, M3D, MG, MR, NM, OAM, OCT, OP, OPM, OPT,
    OPTBSV, OPTENF, OPV, OSS, OT, PA, PLAN, POS, PR, PT, PX, REG, RESP, RF, RG, RTDOSE, RTIMAGE,
    RTINTENT, RTPLAN, RTRAD, RTRECORD, RTSEGANN, RTSTRUCT, RWV, SEG, SM, SMR, SR, SRF, STAIN,
    TEXTUREMAP, TG, US, VA, XA, XAPROTOCOL, XC,
    AS, CD, CF, CP, CS, DD, DF, DM, DS, EC, FA, FS, LP, MA, MS, OPR, ST, VF
""")  # the second line: retired terms, still found in older files

BODY_PART_EXAMINED = _terms("""
    ABDOMEN, ABDOMENPELVIS, ABDOMINALAORTA, ACJOINT, ADRENAL, AMNIOTICFLUID, ANKLE, ANUS, AORTA,
    AORTICARCH, APPENDIX, ARM, ARTERY, ASCAORTA, ATRIUM, AXILLA, BACK, BILEDUCT, BLADDER, BONE, BRAIN,
    BREAST, BRONCHUS, BUTTOCK, CALCANEUS, CALF, CAROTID, CECUM, CEREBELLUM, CERVIX, CHEEK, CHEST,
    CHESTABDOMEN, CHESTABDPELVIS, CIRCLEOFWILLIS, CLAVICLE, COCCYX, COLON, COMMONBILEDUCT, CORNEA,
    CORONARYARTERY, CSPINE, CTSPINE, DUODENUM, EAR, ELBOW, ENDOMETRIUM, ESOPHAGUS, EXTREMITY, EYE,
    EYELID, FACE, FEMUR, FIBULA, FINGER, FOOT, FOREARM, GALLBLADDER, HAND, HEAD, HEADNECK, HEART, HEEL,
    HIP, HUMERUS, IAC, ILEUM, ILIUM, INTESTINE, JAW, JEJUNUM, KIDNEY, KNEE, LARYNX, LEG, LIVER,
    LOWERLIMB, LSPINE, LSSPINE, LUNG, MANDIBLE, MAXILLA, MEDIASTINUM, MOUTH, NASOPHARYNX, NECK,
    NECKCHEST, NECKCHESTABDOMEN, NECKCHESTABDPELV, NOSE, ORBIT, OVARY, PANCREAS, PAROTID, PATELLA,
    PELVIS, PENIS, PERINEUM, PHARYNX, PLACENTA, PROSTATE, RADIUS, RECTUM, RIB, SACROILIACJOINT,
    SACRUM, SCAPULA, SCLERA, SCROTUM, SELLA, SHOULDER, SINUS, SKULL, SMALLINTESTINE, SPINE, SPLEEN,
    STERNUM, STOMACH, SUBMANDIBULAR, TESTIS, THIGH, THORACICAORTA, THUMB, THYMUS, THYROID, TIBIA,
    TLSPINE, TMJ, TOE, TONGUE, TONSIL, TOOTH, TRACHEA, TSPINE, ULNA, UPPERLIMB, URETER, URETHRA,
    UTERUS, VAGINA, VEIN, VENACAVA, VERTEBRA, VULVA, WHOLEBODY, WRIST, ZYGOMA
""")

IMAGE_TYPE_PIXEL_DATA = _terms("ORIGINAL, DERIVED")  # value 1
IMAGE_TYPE_EXAMINATION = _terms("PRIMARY, SECONDARY")  # value 2
IMAGE_TYPE_FURTHER = _terms("""
    AXIAL, LOCALIZER, OTHER, REFORMATTED, MPR, MIP, MINIP, VOLUME, PROJECTION IMAGE, SUBTRACTION,
    T1 MAP, T2 MAP, DIFFUSION MAP, DENSITY MAP, PHASE MAP, VELOCITY MAP, IMAGE ADDITION, PHASE SUBTRACT,
    MODULUS SUBTRACT, SINGLE PLANE, BIPLANE A, BIPLANE B, STATIC, DYNAMIC, GATED, WHOLE BODY, TOMO,
    GATED TOMO, RECON TOMO, RECON GATED TOMO, EMISSION, TRANSMISSION, DRR, PORTAL, SIMULATOR, FLUENCE,
    VERIFICATION, ANGIO, CARDIAC, CINE, DIFFUSION, FLOW_ENCODED, FLUID_ATTENUATED, FMRI, MAX_IP, MIN_IP,
    PROTON_DENSITY, REALTIME, STIR, STRESS, T1, T2, T2_STAR, TOF, VELOCITY, PERFUSION, ATTENUATION,
    MAGNITUDE, PHASE, REAL, IMAGINARY, ADDITION, DIVISION, MULTIPLICATION, MIXED, NONE
""")  # values 3 and later: modality-specific terms (CT, MR, XA, NM, RT image, enhanced images)

PATIENT_POSITION = _terms("""
    HFP, HFS, HFDR, HFDL, FFDR, FFDL, FFP, FFS, LFP, LFS, RFP, RFS, AFDR, AFDL, PFDR, PFDL
""")
VIEW_POSITION = _terms("""
    AP, PA, LL, RL, RLD, LLD, RLO, LLO, LAO, RAO, LPO, RPO, LATERAL, CC, FB, LM, LMO, ML, MLO, SIO,
    XCC, XCCL, XCCM, AT, RCC, LCC, RMLO, LMLO
""")
LATERALITY = _terms("R, L")
IMAGE_LATERALITY = _terms("R, L, U, B")
PHOTOMETRIC_INTERPRETATION = _terms("""
    MONOCHROME1, MONOCHROME2, PALETTE COLOR, RGB, YBR_FULL, YBR_FULL_422, YBR_PARTIAL_422,
    YBR_PARTIAL_420, YBR_ICT, YBR_RCT, HSV, ARGB, CMYK, XYB
""")
RESCALE_TYPE = _terms("OD, HU, US, MGML, Z_EFF, ED, EDW, HU_MOD, PCT")
MR_ACQUISITION_TYPE = _terms("2D, 3D")
SCANNING_SEQUENCE = _terms("SE, IR, GR, EP, RM")
SEQUENCE_VARIANT = _terms("SK, MTC, SS, TRSS, SP, MP, OSP, NONE")
YES_NO = _terms("YES, NO")
LOSSY_IMAGE_COMPRESSION = _terms("00, 01")

# Each coded attribute deid.py keeps, with the terms every one of its values must be among.
# ImageType is ordered (value 1, value 2, then further values) and is checked in deid.py itself.
DEFINED_TERMS: dict[str, frozenset[str]] = {
    "Modality": MODALITY,
    "BodyPartExamined": BODY_PART_EXAMINED,
    "PatientPosition": PATIENT_POSITION,
    "ViewPosition": VIEW_POSITION,
    "Laterality": LATERALITY,
    "ImageLaterality": IMAGE_LATERALITY,
    "PhotometricInterpretation": PHOTOMETRIC_INTERPRETATION,
    "RescaleType": RESCALE_TYPE,
    "MRAcquisitionType": MR_ACQUISITION_TYPE,
    "ScanningSequence": SCANNING_SEQUENCE,
    "SequenceVariant": SEQUENCE_VARIANT,
    "BurnedInAnnotation": YES_NO,
    "LossyImageCompression": LOSSY_IMAGE_COMPRESSION,
}
